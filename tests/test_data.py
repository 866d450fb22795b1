"""Datasets: shipped files, row counts, splits, the registry, the synthetic task, DP sampling."""
import hashlib
import json

import pytest

from megadiv.data import (
    DATASETS,
    DataConfig,
    DatasetError,
    DatasetSpec,
    PromptSampler,
    Record,
    char_tokenizer,
    epoch_permutation,
    load_dataset,
    register_dataset,
    shard,
)
from megadiv.data.datasets import FILES, MBPP_SPLITS

# From megadiv/data/files/SOURCES.md (copied from the upstream commits listed there).
SHA256 = {
    "gsm8k/train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "gsm8k/test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "math500/test.jsonl": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
    "aime24/test.jsonl": "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac",
    "aime25/test.jsonl": "5ee6e9fb9b8c0408c8e3591709b6927063abf73ed238c029167a7eff7376cca0",
    "mbpp/mbpp.jsonl": "0b5e07b5b40fedd01c57b7c9177b79f8b2eebd72c304c928605d91a7237d2f33",
    "mbpp/sanitized-mbpp.json": "8ac32b2799150228e2d745aed09c870b7e4444246d4727d1004576207ef40769",
}

COUNTS = [("gsm8k", "train", 7473), ("gsm8k", "test", 1319), ("math500", "test", 500), ("aime24", "test", 30),
          ("aime25", "test", 30), ("mbpp", "all", 974), ("mbpp", "prompt", 10), ("mbpp", "test", 500),
          ("mbpp", "validation", 90), ("mbpp", "train", 374), ("mbpp_sanitized", "all", 427),
          ("mbpp_sanitized", "test", 257)]


def test_shipped_files_match_sources_and_carry_licenses():
    sources = (FILES / "SOURCES.md").read_text()
    for rel, digest in SHA256.items():
        assert hashlib.sha256((FILES / rel).read_bytes()).hexdigest() == digest, rel
        assert digest in sources and rel in sources
    for d in ("gsm8k", "math500", "aime24", "aime25", "mbpp"):
        assert any(p.name.startswith(("LICENSE", "NOTICE")) for p in (FILES / d).iterdir()), d


@pytest.mark.parametrize("name,split,rows", COUNTS)
def test_row_counts(name, split, rows):
    ds = load_dataset(DataConfig(name=name, split=split))
    assert len(ds) == rows and len({r.id for r in ds}) == rows
    assert all(r.prompt for r in ds)
    if ds.answer_format == "code":
        assert all(r.tests and r.solution for r in ds)
    else:
        assert all(r.answer for r in ds)


def test_fields_and_mbpp_split_by_task_id():
    gsm = load_dataset(DataConfig(name="gsm8k", split="test"))
    assert gsm[0].answer == "18" and gsm[0].solution.endswith("#### 18") and gsm.answer_format == "hash"
    assert all("," not in r.answer for r in gsm)  # thousands separators removed from golds
    for split, (lo, hi) in MBPP_SPLITS.items():
        ids = [int(r.id.split("/")[1]) for r in load_dataset(DataConfig(name="mbpp", split=split))]
        assert ids == list(range(lo, hi + 1))
    mbpp = load_dataset(DataConfig(name="mbpp", split="test"))
    assert mbpp[0].id == "mbpp/11" and mbpp[0].tests[0].startswith("assert remove_Occ")
    assert sum(bool(r.test_setup) for r in load_dataset(DataConfig(name="mbpp", split="all"))) > 0
    assert len(load_dataset(DataConfig(name="mbpp", split="test", max_items=5))) == 5


def test_truncated_file_is_rejected(monkeypatch, tmp_path):
    (tmp_path / "gsm8k").mkdir()
    lines = (FILES / "gsm8k" / "test.jsonl").read_text().splitlines()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    monkeypatch.setattr("megadiv.data.datasets.FILES", tmp_path)
    with pytest.raises(DatasetError, match="gsm8k/test: expected 1319 rows, found 1318"):
        load_dataset(DataConfig(name="gsm8k", split="test"))


def test_unknown_name_split_and_bad_config():
    with pytest.raises(DatasetError, match="unknown dataset 'gsm9k'"):
        load_dataset(DataConfig(name="gsm9k"))
    with pytest.raises(DatasetError, match="no split 'dev'"):
        load_dataset(DataConfig(name="gsm8k", split="dev"))
    with pytest.raises(ValueError, match="data.path"):
        DataConfig(name="jsonl")
    with pytest.raises(ValueError, match="data.arithmetic_digits"):
        DataConfig(arithmetic_digits=0)


def test_jsonl_dataset_from_config(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"What is {i}+1?", "a": i + 1, "key": f"k{i}"}) for i in range(4)))
    ds = load_dataset(DataConfig(name="jsonl", split="train", path=str(path), prompt_field="q", answer_field="a",
                                 id_field="key", expected_rows=4))
    assert [r.id for r in ds] == ["k0", "k1", "k2", "k3"] and ds[2].answer == "3" and ds.answer_format == "boxed"
    with pytest.raises(DatasetError, match="expected 5 rows, found 4"):
        load_dataset(DataConfig(name="jsonl", path=str(path), prompt_field="q", answer_field="a", expected_rows=5))
    with pytest.raises(DatasetError, match="no field 'question'"):
        load_dataset(DataConfig(name="jsonl", path=str(path), prompt_field="question", answer_field="a"))
    code = tmp_path / "code.jsonl"
    code.write_text(json.dumps({"prompt": "add", "tests": ["assert add(1, 2) == 3"]}) + "\n")
    ds = load_dataset(DataConfig(name="jsonl", path=str(code), answer_field=None, tests_field="tests"))
    assert ds[0].tests == ("assert add(1, 2) == 3",) and ds[0].answer is None
    # A record without tests would be graded on nothing: the loader refuses it.
    for empty in ([], [""]):
        code.write_text(json.dumps({"prompt": "add", "tests": ["assert add(1, 2) == 3"]}) + "\n"
                        + json.dumps({"prompt": "sub", "tests": empty}) + "\n")
        with pytest.raises(DatasetError, match="row 1 field 'tests' must be a non-empty list"):
            load_dataset(DataConfig(name="jsonl", path=str(code), answer_field=None, tests_field="tests"))


def test_register_dataset():
    spec = DatasetSpec(lambda cfg: [Record(id=str(i), prompt=f"{i}*2=", answer=str(2 * i)) for i in range(3)],
                       {"train": 3}, "none", "exact_match")
    register_dataset("doubling", spec)
    try:
        assert [r.answer for r in load_dataset(DataConfig(name="doubling"))] == ["0", "2", "4"]
        with pytest.raises(DatasetError, match="already registered"):
            register_dataset("doubling", spec)
    finally:
        del DATASETS["doubling"]


def test_arithmetic_task_is_deterministic_disjoint_and_correct():
    test = load_dataset(DataConfig(name="arithmetic", split="test"))
    train = load_dataset(DataConfig(name="arithmetic", split="train"))
    assert len(test) == 500 and len(train) == 100 * 100 - 500
    assert {r.prompt for r in test}.isdisjoint({r.prompt for r in train})
    for r in list(test) + list(train):
        a, b = r.prompt.rstrip("=").split("+")
        assert int(r.answer) == int(a) + int(b) and 0 <= int(a) <= 99 and 0 <= int(b) <= 99
    # The held-out set depends on arithmetic_seed only: not on the training size nor the shuffle seed.
    small = load_dataset(DataConfig(name="arithmetic", split="test", arithmetic_train_size=100, seed=7))
    assert [r.prompt for r in small] == [r.prompt for r in test]
    other = load_dataset(DataConfig(name="arithmetic", split="test", arithmetic_seed=1))
    assert [r.prompt for r in other] != [r.prompt for r in test]
    # Difficulty knobs: three 4-digit operands (rejection sampling path, > 2M problems).
    hard = load_dataset(DataConfig(name="arithmetic", split="train", arithmetic_digits=4, arithmetic_operands=3,
                                   arithmetic_train_size=50, arithmetic_test_size=20))
    assert len(hard) == 50 and all(r.prompt.count("+") == 2 for r in hard)
    with pytest.raises(DatasetError, match="arithmetic_train_size must be set"):
        load_dataset(DataConfig(name="arithmetic", split="train", arithmetic_digits=4, arithmetic_operands=3))


def test_char_tokenizer_round_trip():
    tok = char_tokenizer()
    assert len(tok) == 15 and tok.eos_token_id == 2 and tok.pad_token_id == 0
    ids = tok("17+25=")["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "17+25="
    assert tok.decode(tok("42")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "42"


@pytest.mark.parametrize("n,batch,world", [(10, 4, 2), (7, 6, 3), (5, 8, 4)])
def test_sampler_shards_are_disjoint_cover_each_epoch_and_resume(n, batch, world):
    samplers = [PromptSampler(n, batch, rank, world, seed=3) for rank in range(world)]
    stream = []
    for _ in range(6):
        parts = [s.next_batch() for s in samplers]
        assert all(len(p) == batch // world for p in parts)
        stream += [i for p in parts for i in p]  # rank order = global batch order
    for e in range(len(stream) // n):  # every full epoch is a permutation
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    assert stream[:n] == epoch_permutation(n, 3, 0) and stream[n:2 * n] == epoch_permutation(n, 3, 1)
    # Resume: a fresh sampler loaded from a state continues the same stream.
    resumed = PromptSampler(n, batch, 1, world, seed=3)
    resumed.load_state_dict(samplers[1].state_dict())
    assert resumed.next_batch() == samplers[1].next_batch()
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(n, batch, 1, world, seed=4).load_state_dict(samplers[1].state_dict())


def test_unshuffled_sampler_and_eval_shard():
    assert epoch_permutation(50, 3, 0) != epoch_permutation(50, 4, 0) != epoch_permutation(50, 4, 1)
    assert epoch_permutation(50, 3, 0) == epoch_permutation(50, 3, 0)
    s = PromptSampler(5, 2, shuffle=False)
    assert [s.next_batch() for _ in range(3)] == [[0, 1], [2, 3], [4, 0]] and s.epoch == 1
    items = list(range(11))
    shares = [shard(items, r, 3) for r in range(3)]
    assert sorted(sum(shares, [])) == items and max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError, match="divisible"):
        PromptSampler(5, 3, 0, 2)


def test_gbmpo_mbpp_split_is_the_authors_299_75_of_train():
    from megadiv.data.datasets import gbmpo_mbpp_task_ids

    train, val = gbmpo_mbpp_task_ids("gbmpo_train"), gbmpo_mbpp_task_ids("gbmpo_validation")
    assert len(train) == 299 and len(val) == 75 and not set(train) & set(val)
    assert sorted(train + val) == list(range(601, 975))  # MBPP's train split, task ids 601-974
    # numpy RandomState(42).permutation(374) starts 329, 33, 15, 325, 57 (= sklearn's
    # train_test_split(test_size=0.2, random_state=42) test side): tasks 601 + i
    assert val[:5] == [930, 634, 616, 926, 658]
    records = load_dataset(DataConfig(name="mbpp", split="gbmpo_validation"))
    assert [r.id for r in records][:2] == ["mbpp/930", "mbpp/634"] and all(r.tests for r in records)


def test_gbmpo_gsm8k_es_split_is_disjoint_80_20_of_train():
    """The GSM8K ES split (authors' get_gsm8k_splits: train_test_split(range(7473), test_size=0.2,
    random_state=42)); their training script ignores it and trains on all of train, so inner
    training and validation overlap there; here they are disjoint and cover train exactly."""
    import numpy as np

    train = load_dataset(DataConfig(name="gsm8k", split="gbmpo_train"))
    val = load_dataset(DataConfig(name="gsm8k", split="gbmpo_validation"))
    assert len(train.records) == 5978 and len(val.records) == 1495
    ids_t, ids_v = {r.id for r in train.records}, {r.id for r in val.records}
    assert not ids_t & ids_v and ids_t | ids_v == {f"gsm8k/train/{i}" for i in range(7473)}
    first = int(np.random.RandomState(42).permutation(7473)[0])
    full = load_dataset(DataConfig(name="gsm8k", split="train"))
    assert val.records[0] == full.records[first]


def test_user_code_records_take_solution_setup_and_program_names_fields(tmp_path):
    code = tmp_path / "code.jsonl"
    row = {"prompt": "sum of divisors", "tests": ["assert sum(10, 15) == 6"], "setup": ["import math", "K = 1"],
           "ref": "def sum(a, b):\n    return 6", "own": []}
    code.write_text(json.dumps(row) + "\n")
    fields = dict(name="jsonl", path=str(code), answer_field=None, tests_field="tests")
    r = load_dataset(DataConfig(**fields, solution_field="ref", test_setup_field="setup"))[0]
    assert (r.program_names, r.test_setup, r.solution) == (("sum",), "import math\nK = 1", row["ref"])
    assert load_dataset(DataConfig(**fields, program_names_field="own", solution_field="ref"))[0].program_names == ("sum",)
    # Without either, `sum` is Python's and the test calls nothing of the program: refused.
    with pytest.raises(DatasetError, match="0: test 0 cannot be graded: .*makes no call into the program"):
        load_dataset(DataConfig(**fields))
    code.write_text(json.dumps({**row, "ref": "def sum(a, b) return 6", "own": ["not a name"]}) + "\n")
    with pytest.raises(DatasetError, match="row 0 field 'ref' is not a Python program"):
        load_dataset(DataConfig(**fields, solution_field="ref"))
    with pytest.raises(DatasetError, match="row 0 field 'own' must be a list of names"):
        load_dataset(DataConfig(**fields, program_names_field="own"))
    with pytest.raises(ValueError, match="data.solution_field is read from a user's file only"):
        DataConfig(name="mbpp", solution_field="code")
    with pytest.raises(ValueError, match="data.test_setup_field needs tests_field"):
        DataConfig(name="jsonl", path=str(code), test_setup_field="setup")
