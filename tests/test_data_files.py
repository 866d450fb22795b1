"""A user's own files through Hugging Face ``datasets`` (``data.name: hf``): Parquet (flat, and verl's
nested layout with chat-message prompts), JSON, JSONL, CSV and a save_to_disk directory; dotted
field names; chat-message prompts rendered by the chat template; every bad file one line naming
the file, the row and the field (also through check-config). Files are written here with pyarrow
and datasets; tests/test_trainer_files.py trains on them."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megadiv.data import DataConfig, DatasetError, PromptTemplate, load_dataset
from megadiv.models.tiny import build_tokenizer

PROBLEMS = [("12+30=", "42"), ("7+8=", "15"), ("50+25=", "75")]
VERL_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def verl_rows(problems=PROBLEMS, split: str = "train") -> list[dict]:
    """Rows in verl's RL layout (its examples/data_preprocess/gsm8k.py): data_source, prompt as a
    list of chat messages, ability, reward_model {style, ground_truth}, extra_info."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{question} {VERL_INSTRUCTION}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
             "extra_info": {"split": split, "index": i, "answer": f"{question}{answer} #### {answer}",
                            "question": question}}
            for i, (question, answer) in enumerate(problems)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def flat_rows(problems=PROBLEMS) -> list[dict]:
    return [{"question": q, "final": a, "uid": f"p-{i}"} for i, (q, a) in enumerate(problems)]


VERL = dict(name="hf", answer_field="reward_model.ground_truth", id_field="extra_info.index")
FLAT = dict(name="hf", prompt_field="question", answer_field="final", id_field="uid")


def test_every_format_gives_the_same_records(tmp_path):
    import datasets

    rows = flat_rows()
    files = {"parquet": write_parquet(tmp_path / "flat.parquet", rows), "jsonl": tmp_path / "flat.jsonl",
             "json": tmp_path / "flat.json", "csv": tmp_path / "flat.csv", "save_to_disk": tmp_path / "saved"}
    files["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    files["json"].write_text(json.dumps(rows))
    files["csv"].write_text("question,final,uid\n" + "".join(f"{r['question']},{r['final']},{r['uid']}\n" for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(files["save_to_disk"]))
    for kind, path in files.items():
        ds = load_dataset(DataConfig(path=str(path), expected_rows=3, **FLAT))
        assert [(r.id, r.prompt, r.answer, r.messages) for r in ds] == \
            [(f"p-{i}", q, a, ()) for i, (q, a) in enumerate(PROBLEMS)], kind
    with pytest.raises(DatasetError, match="expected 4 rows, found 3"):
        load_dataset(DataConfig(path=str(files["parquet"]), expected_rows=4, **FLAT))


def test_a_saved_dataset_dict_picks_the_split(tmp_path):
    import datasets

    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(flat_rows()),
                          "test": datasets.Dataset.from_list(flat_rows(PROBLEMS[:1]))}).save_to_disk(str(saved))
    assert len(load_dataset(DataConfig(path=str(saved), split="test", **FLAT))) == 1
    assert len(load_dataset(DataConfig(path=str(saved), split="train", **FLAT))) == 3
    with pytest.raises(DatasetError, match=r"has no split 'validation'; splits: \['test', 'train'\]"):
        load_dataset(DataConfig(path=str(saved), split="validation", **FLAT))


def test_verl_parquet_loads_as_it_is_and_renders_with_the_chat_template(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows())
    ds = load_dataset(DataConfig(path=str(path), **VERL))
    assert [r.id for r in ds] == ["0", "1", "2"] and [r.answer for r in ds] == ["42", "15", "75"]
    assert ds[0].messages == (("user", f"12+30= {VERL_INSTRUCTION}"),) and ds[0].prompt == f"12+30= {VERL_INSTRUCTION}"
    tok = build_tokenizer("bpe")
    tpl = PromptTemplate.resolve(DataConfig(path=str(path), **VERL), ds, tok)
    # the messages as the file gives them: no answer-format instruction or system message added
    assert tpl.text(ds[1], tok) == tok.apply_chat_template([{"role": "user", "content": f"7+8= {VERL_INSTRUCTION}"}],
                                                           tokenize=False, add_generation_prompt=True)
    assert tok.decode(tpl.token_ids(ds[1], tok)) == tpl.text(ds[1], tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="holds chat messages.*this tokenizer has none"):
        PromptTemplate.resolve(DataConfig(path=str(path), **VERL), ds, tok)
    for key, value in [("template", "plain"), ("system_prompt", "Be brief."), ("answer_format", "boxed")]:
        with pytest.raises(ValueError, match=f"data.{key}"):
            PromptTemplate.resolve(DataConfig(path=str(path), **VERL, **{key: value}), ds, build_tokenizer("bpe"))


def one_line_error(cfg: DataConfig) -> str:
    with pytest.raises(DatasetError) as err:
        load_dataset(cfg)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_files_give_one_line_naming_file_row_and_field(tmp_path):
    rows = verl_rows()
    del rows[2]["reward_model"]["ground_truth"]  # pyarrow fills the missing struct field with null
    path = write_parquet(tmp_path / "verl.parquet", rows)
    assert one_line_error(DataConfig(path=str(path), **VERL)) == \
        f"{path}: row 2 field 'reward_model.ground_truth' is null, expected str or int or float"
    assert one_line_error(DataConfig(path=str(path), **{**VERL, "answer_field": "reward_model.truth"})) == \
        f"{path}: row 0 has no field 'reward_model.truth' ('reward_model' holds ['ground_truth', 'style'])"
    assert one_line_error(DataConfig(path=str(path), **{**VERL, "prompt_field": "question"})) == \
        (f"{path}: row 0 has no field 'question' (fields: ['ability', 'data_source', 'extra_info', 'prompt', "
         f"'reward_model'])")
    messages = verl_rows()
    messages[1]["prompt"] = [{"role": "user", "text": "12+30="}]
    path = write_parquet(tmp_path / "messages.parquet", messages)
    assert one_line_error(DataConfig(path=str(path), **VERL)) == \
        f"{path}: row 1 field 'prompt' message 0 has content null, expected a string"
    numbers = tmp_path / "numbers.json"
    numbers.write_text(json.dumps([{"question": "1+1=", "final": "2"}, {"question": 7, "final": "3"}]))
    assert one_line_error(DataConfig(path=str(numbers), name="hf", prompt_field="question", answer_field="final")) \
        == f"{numbers}: row 1 field 'question' is int 7, expected a string or a list of chat messages"
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"question": "1+1=", "final": "2"}\n{"question": "2+2=", "final": \n')
    assert one_line_error(DataConfig(path=str(torn), name="hf", prompt_field="question")).startswith(
        f"{torn}:2: not valid JSON")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("question,final\n1+1=,2\n2+2=,4,extra\n")
    assert one_line_error(DataConfig(path=str(ragged), name="hf", prompt_field="question", answer_field="final")) \
        == f"{ragged}: not a readable csv file: Error tokenizing data. C error: Expected 2 fields in line 3, saw 3"
    odd = tmp_path / "data.txt"
    odd.write_text("x")
    assert "reads .parquet, .pq, .json, .jsonl, .csv files or a save_to_disk directory" in one_line_error(
        DataConfig(path=str(odd), name="hf"))
    assert one_line_error(DataConfig(path=str(tmp_path / "none.parquet"), name="hf")) == \
        f"data.path: no such file or directory {tmp_path / 'none.parquet'}"


def test_check_config_reports_a_bad_file_in_one_line(tmp_path, capsys):
    from megadiv.cli import main

    rows = verl_rows()
    rows[1]["reward_model"]["ground_truth"] = None
    path = write_parquet(tmp_path / "verl.parquet", rows)
    base = [str(Path(__file__).resolve().parents[1] / "examples" / "tiny" / "grpo.yaml"),
            f"run.output_dir={tmp_path}", f"model.hf_dir={tmp_path}/init", "data.name=hf", f"data.path={path}",
            "data.answer_field=reward_model.ground_truth", "data.template=auto"]
    assert main(["check-config", *base]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"megadiv: invalid config: data: {path}: row 1 field 'reward_model.ground_truth' is null, "
                   f"expected str or int or float"]
    assert main(["check-config", *base, "data.answer_field=reward_model.gold"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert f"{path}: row 0 has no field 'reward_model.gold'" in line
    good = write_parquet(tmp_path / "good.parquet", verl_rows())
    assert main(["check-config", *base, f"data.path={good}", "data.answer_format=hash"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert line == (f"megadiv: invalid config: data: data.answer_format does not apply to the chat-message prompts of "
                    f"{good}: they are rendered as the file gives them (put a system message or instruction in the file)")
