"""Datasets, prompt templates and prompt sampling.

- :func:`load_dataset` (registry :data:`DATASETS`, :func:`register_dataset`): GSM8K, MATH-500,
  AIME 2024/2025, MBPP (+ sanitized), the synthetic arithmetic task, graded arithmetic word
  problems, and a user's files (user_files.py: JSONL, and through Hugging Face ``datasets``
  Parquet, JSON, CSV and save_to_disk directories); row counts are checked on every load.
- :class:`PromptTemplate`: chat or plain templates that state the answer format.
- :class:`PromptSampler` / :func:`shard`: deterministic epoch shuffles split across DP ranks.

Imports nothing from the rest of megadiv.
"""
# registration order is the order DATASETS lists: the built-in datasets, "arithmetic", then "jsonl",
# "hf" (a user's files) and "word_arithmetic"
from megadiv.data.arithmetic import char_tokenizer  # importing it registers the "arithmetic" dataset

# isort: split
from megadiv.data import user_files, word_problems  # noqa: F401  (register "jsonl", "hf", "word_arithmetic")
from megadiv.data.config import DataConfig
from megadiv.data.datasets import DATASETS, Dataset, DatasetError, DatasetSpec, Record, load_dataset, register_dataset
from megadiv.data.sampler import PromptSampler, epoch_permutation, shard
from megadiv.data.templates import INSTRUCTIONS, PromptTemplate, problem_text

__all__ = ["DATASETS", "DataConfig", "Dataset", "DatasetError", "DatasetSpec", "INSTRUCTIONS", "PromptSampler",
           "PromptTemplate", "Record", "char_tokenizer", "epoch_permutation", "load_dataset", "problem_text",
           "register_dataset", "shard"]
