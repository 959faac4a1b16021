"""The backend-agnostic Psyche training client."""
