"""DisTrO optimizer, trainer and Hugging Face model loading for Psyche."""
