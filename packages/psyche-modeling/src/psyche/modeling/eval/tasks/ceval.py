"""C-Eval (upstream `tasks/ceval.rs`): ceval/ceval-exam, the val split of each of its 52
subjects scored (in the subject order below), each subject's dev split for few-shot. The prompt
carries the subject's Chinese name in its description; scored on the letters A-D."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    Document,
    check_answer,
    letter_index,
    rust_trim,
    string_field,
)
from psyche.modeling.eval.loading import DatasetSource, Row
from psyche.modeling.eval.traits import LogLikelihoodTask, by_category

REPO = "ceval/ceval-exam"

SUBJECT_MAPPING: tuple[tuple[str, str], ...] = (
    ("accountant", "注册会计师"),
    ("advanced_mathematics", "高等数学"),
    ("art_studies", "艺术学"),
    ("basic_medicine", "基础医学"),
    ("business_administration", "工商管理"),
    ("chinese_language_and_literature", "中国语言文学"),
    ("civil_servant", "公务员"),
    ("clinical_medicine", "临床医学"),
    ("college_chemistry", "大学化学"),
    ("college_economics", "大学经济学"),
    ("college_physics", "大学物理"),
    ("college_programming", "大学编程"),
    ("computer_architecture", "计算机组成"),
    ("computer_network", "计算机网络"),
    ("discrete_mathematics", "离散数学"),
    ("education_science", "教育学"),
    ("electrical_engineer", "注册电气工程师"),
    ("environmental_impact_assessment_engineer", "环境影响评价工程师"),
    ("fire_engineer", "注册消防工程师"),
    ("high_school_biology", "高中生物"),
    ("high_school_chemistry", "高中化学"),
    ("high_school_chinese", "高中语文"),
    ("high_school_geography", "高中地理"),
    ("high_school_history", "高中历史"),
    ("high_school_mathematics", "高中数学"),
    ("high_school_physics", "高中物理"),
    ("high_school_politics", "高中政治"),
    ("ideological_and_moral_cultivation", "思想道德修养与法律基础"),
    ("law", "法学"),
    ("legal_professional", "法律职业资格"),
    ("logic", "逻辑学"),
    ("mao_zedong_thought", "毛泽东思想和中国特色社会主义理论体系概论"),
    ("marxism", "马克思主义基本原理"),
    ("metrology_engineer", "注册计量师"),
    ("middle_school_biology", "初中生物"),
    ("middle_school_chemistry", "初中化学"),
    ("middle_school_geography", "初中地理"),
    ("middle_school_history", "初中历史"),
    ("middle_school_mathematics", "初中数学"),
    ("middle_school_physics", "初中物理"),
    ("middle_school_politics", "初中政治"),
    ("modern_chinese_history", "近代史纲要"),
    ("operating_system", "操作系统"),
    ("physician", "医师资格"),
    ("plant_protection", "植物保护"),
    ("probability_and_statistics", "概率统计"),
    ("professional_tour_guide", "导游资格"),
    ("sports_science", "体育学"),
    ("tax_accountant", "税务师"),
    ("teacher_qualification", "教师资格"),
    ("urban_and_rural_planner", "注册城乡规划师"),
    ("veterinary_medicine", "兽医学"),
)


def subject_chinese_name(subject_en: str) -> str:
    # "Unknown subject": never reached for the subjects above.
    return dict(SUBJECT_MAPPING).get(subject_en, "未知学科")


class CEval(LogLikelihoodTask):
    NAME = "CEval-valid"

    def __init__(self, datasets: list[tuple[list[Row], list[Row], str]]) -> None:
        """`datasets`: (val rows, dev rows, English subject name) for each subject."""
        self.name = self.NAME
        self._datasets = datasets

    @classmethod
    def load(cls, source: DatasetSource) -> CEval:
        return cls(
            [
                (source.load(REPO, "val", subject), source.load(REPO, "dev", subject), subject)
                for subject, _ in SUBJECT_MAPPING
            ]
        )

    @classmethod
    def row_to_document(cls, row: Row, subject_en: str) -> Document:
        question = rust_trim(string_field(row, "question"))
        a, b, c, d = (string_field(row, letter) for letter in "ABCD")
        subject = subject_chinese_name(subject_en)
        description = f"以下是中国关于{subject}的单项选择题，请选出其中的正确答案。\n\n"
        choices = ("A", "B", "C", "D")
        return Document(
            text=f"{description}{question}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\n答案：",
            choices=choices,
            answer=check_answer(letter_index(string_field(row, "answer"), "answer", 4), choices),
            category=subject,
            cot_content=None,
            eval_name=cls.NAME,
        )

    def get_documents(self) -> list[Document]:
        return [
            self.row_to_document(row, subject) for val, _, subject in self._datasets for row in val
        ]

    def get_fewshot_documents(self) -> dict[str, list[Document]]:
        return by_category(
            [
                self.row_to_document(row, subject)
                for _, dev, subject in self._datasets
                for row in dev
            ]
        )
