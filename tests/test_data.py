"""graph_trainer.data: corpus, tokenizer, datasets; bad data or tokenizers named in one line (``file:line``)."""

import gzip
from itertools import islice
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset, build_text_dataloader

import _early  # tests/ is on sys.path
from _runs import DEBUG, LAUNCH_VARS, REPO, SMALL, run_debug
from graph_trainer import config, data
from graph_trainer.errors import UserError

VOCAB = 2048


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache dir (and HF datasets cache) for this module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPH_TRAINER_CACHE", str(root := tmp_path_factory.mktemp("gt_cache")))
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf"))
        data.register_datasets()  # re-point c4_test at this cache
        yield root
    data.register_datasets()


@pytest.fixture(scope="module")
def tokenizer(cache):
    return HuggingFaceTokenizer(data.resolve_tokenizer_path(None, VOCAB))


def _read_jsonl_folder(folder) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text("utf-8").splitlines()]


def test_corpus_is_real_english_and_c4_test(cache, tokenizer):
    """The corpus, built once; c4_test reads it through torchtitan's dataset and dataloader."""
    assert (folder := data.ensure_corpus()) == cache / "corpus_v1" and folder.is_dir()
    records = _read_jsonl_folder(folder)
    assert len(records) >= 300 and all(set(r) == {"text"} and r["text"].strip() for r in records)
    words = (text := " ".join(r["text"] for r in records)).lower().split()
    assert len(text) > 500_000 and all(words.count(w) > 100 for w in ("the", "and", "is", "of", "function", "object"))
    mtime = (folder / "part-0000.jsonl").stat().st_mtime_ns
    assert data.ensure_corpus() == folder and (folder / "part-0000.jsonl").stat().st_mtime_ns == mtime  # not rebuilt
    assert not list(cache.glob(".corpus_v1.*[!k]"))  # no leftover tmp folders
    data.register_datasets()
    assert sorted(data.DATASET_NAMES) == sorted(DATASETS)
    assert DATASETS["c4_test"].path == str(cache / "corpus_v1") and DATASETS["c4"].path == "allenai/c4"
    for inputs, labels in (samples := list(islice(HuggingFaceTextDataset("c4_test", None, tokenizer, seq_len=64), 3))):
        assert inputs["input"].shape == (64,) and labels.shape == (64,) and (inputs["input"][1:] == labels[:-1]).all()
    assert samples[0][0]["input"][0].item() == tokenizer.bos_id
    t = (job := JobConfig()).training
    t.dataset, t.dataset_path, t.local_batch_size, t.seq_len = "c4_test", None, 2, 32
    inputs, labels = next(iter(build_text_dataloader(1, 0, tokenizer, job)))
    assert inputs["input"].shape == (2, 32) and labels.shape == (2, 32)


def test_tokenizer(cache, tokenizer, tmp_path, monkeypatch):
    """Round trip with BOS / EOS, trained on English, deterministic, the aliases, padded to large sizes."""
    assert tokenizer.get_vocab_size() == VOCAB and None is not tokenizer.bos_id != tokenizer.eos_id is not None
    assert [tokenizer.token_to_id(t) for t in (data.BOS_TOKEN, data.EOS_TOKEN)] == [tokenizer.bos_id, tokenizer.eos_id]
    for text in ("The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2  # square\n",
                 "naïve café — 日本語 🙂"):
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id and all(0 <= i < VOCAB for i in ids)
        assert tokenizer.decode(ids) == text
    english = "The function returns the value of the object and the list."
    assert len(tokenizer.encode(english)) < len(english) / 3  # common words are single tokens
    config = json.loads(((folder := cache / f"tokenizer_{VOCAB}") / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == (data.BOS_TOKEN, data.EOS_TOKEN)
    assert config["add_bos_token"] is True and config["add_eos_token"] is True
    assert [data.resolve_tokenizer_path(alias, VOCAB) for alias in (None, "", "embedded")] == [str(folder)] * 3
    monkeypatch.setenv("GRAPH_TRAINER_CACHE", str(tmp_path))
    assert (data.ensure_tokenizer(VOCAB) / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    tok = HuggingFaceTokenizer(data.resolve_tokenizer_path("embedded", 32768))
    assert tok.get_vocab_size() == 32768 and tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(UserError, match="at least 258"):
        data.ensure_tokenizer(100)


def test_concurrent_builders_agree(tmp_path):
    """Processes racing on a cold cache agree; preflight (before torchrun) does not import torchtitan."""
    (tmp_path / "good.jsonl").write_text(_lines(10, None))
    code = ("import sys\nfrom types import SimpleNamespace as N\nfrom graph_trainer import data\n"
            f"data.preflight(N(training=N(dataset='local', dataset_path={str(tmp_path / 'good.jsonl')!r}), "
            "model=N(hf_assets_path='embedded')))\nprint('torchtitan' in sys.modules)\n"
            "print(data.ensure_corpus(), data.ensure_tokenizer(512))")
    env = {**os.environ, "GRAPH_TRAINER_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
             for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(set(outs)) == 1 and outs[0].startswith("False\n")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")) == [
        "corpus_v1", "tokenizer_512"]
    assert len(_read_jsonl_folder(tmp_path / "cache" / "corpus_v1")) == len(data.corpus_documents())


def test_local_files_load(cache, tokenizer, tmp_path):
    """A JSONL file, a Parquet file and a folder of JSONL files (and a README) load under any dataset name."""
    texts = [f"Document number {i} talks about the weather and the sea." for i in range(20)]
    lines = [json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)]
    _write(tmp_path, {"docs.jsonl": "".join(lines), "docs.parquet": _parquet(text=texts), "folder/README.md": "ignored",
                      "folder/part-0.jsonl": "".join(lines[:10]), "folder/part-1.jsonl": "".join(lines[10:])})
    data.register_datasets()
    for path in (str(tmp_path / f) for f in ("docs.jsonl", "docs.parquet", "folder")):
        assert data.load_local_text(path)["text"] == texts
        for name in ("local", "c4_test", "c4"):  # any name loads a local dataset_path
            data.check_dataset(name, path)
            data.preflight(_cfg(name, path))
            inputs, labels = next(iter(HuggingFaceTextDataset(name, path, tokenizer, seq_len=16)))
            assert inputs["input"].shape == (16,) and labels.shape == (16,)
            assert tokenizer.decode(inputs["input"].tolist()).startswith(texts[0][:10])


def _cfg(dataset="c4_test", path=None, tokenizer="embedded"):
    """The three fields preflight reads, as a parsed JobConfig holds them (paths as strings)."""
    return SimpleNamespace(training=SimpleNamespace(dataset=dataset, dataset_path=path and str(path)),
                           model=SimpleNamespace(hf_assets_path=tokenizer and str(tokenizer)))


def _lines(n: int = 10, bad_line: int | None = 3, bad: str = "this is not json: true") -> str:
    """``n`` lines of ``{"text": ...}``, line ``bad_line`` (1-based) replaced by ``bad``."""
    return "".join((bad if i == bad_line else json.dumps({"text": f"Line {i} is about the sea."})) + "\n"
                   for i in range(1, n + 1))


def _write(root, files: dict) -> None:
    """Write ``{relative path: text or bytes}`` under ``root``."""
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        getattr(root / name, "write_bytes" if isinstance(content, bytes) else "write_text")(content)


def _parquet(**columns) -> bytes:
    pq.write_table(pa.table(columns), buf := pa.BufferOutputStream())
    return buf.getvalue().to_pybytes()


LOAD = {"load_local_text"}
BOTH, ALL = {"preflight", *LOAD}, {"check_dataset", "preflight", *LOAD}
#: id: (files written under tmp_path, the message's start after ``tmp_path/`` (its file: --training.dataset_path),
#: the checks that refuse it: check_dataset (path only), preflight (first records), load_local_text[, a folder path]).
BAD_DATA = {
    "missing": ({}, "nope.jsonl: does not exist", ALL),
    "not_data": ({"notes.txt": "hello"}, "notes.txt: is not a .json", ALL),
    "no_data_files": ({"d/notes.txt": "hello"}, "d: contains no .json", ALL),
    "json_and_parquet": ({"d/a.jsonl": _lines(1, None), "d/b.parquet": b""}, "d: mixes JSON and Parquet", ALL),
    "garbage": ({"d.jsonl": _lines()}, "d.jsonl:3: not valid JSON (Expecting value", BOTH),
    "truncated": ({"d.jsonl": _lines(bad='{"text": "cut off')}, "d.jsonl:3: not valid JSON (Unterminated", BOTH),
    "not_utf8": ({"d.jsonl": _lines(bad='{"text": "?"}').encode().replace(b"?", b"\xff")},
                 "d.jsonl:3: not valid JSON ('utf-8' codec can't decode byte 0xff", BOTH),
    "empty_line": ({"d.jsonl": _lines(bad="")}, "d.jsonl:3: empty line", BOTH),
    "no_text": ({"d.jsonl": _lines(bad='{"body": "x"}')}, "d.jsonl:3: no 'text' field in {\"body\"", BOTH),
    "null_text": ({"d.jsonl": _lines(bad='{"text": null}')}, "d.jsonl:3: 'text' is null, not a string", BOTH),
    "number_text": ({"d.jsonl": _lines(bad='{"text": 7}')}, "d.jsonl:3: 'text' is 7, not a string", BOTH),
    "deep": ({"d.jsonl": _lines(2500, 2000)}, "d.jsonl:2000: not valid JSON", BOTH),
    "deep_null_text": ({"d.jsonl": _lines(2500, 2000, '{"text": null}')}, "d.jsonl:2000: 'text' is null", LOAD),
    "gzipped": ({"d.jsonl.gz": gzip.compress(_lines().encode())}, "d.jsonl.gz:3: not valid JSON", BOTH),
    "2nd_file": ({"d/a.jsonl": _lines(3, None), "d/b.jsonl": _lines(3, 1)}, "d/b.jsonl:1: not valid JSON", BOTH, "d"),
    "empty_first_file": ({"d/a.jsonl": "", "d/b.jsonl": _lines(3, None)}, "d/a.jsonl: holds no records", BOTH, "d"),
    "array_syntax": ({"d.json": '[\n  {"text": "a"},\n  {"text": "b"\n'}, "d.json:4: not valid JSON", BOTH),
    "array_item": ({"d.json": '[{"text": "a"}, {"text": 2}]'}, "d.json: record 2 of the JSON array: 'text' is 2", LOAD),
    "no_text_column": ({"d.jsonl": '{"body": "x"}\n'}, "d.jsonl: no 'text' column (columns: body)", BOTH),
    "parquet_corrupt": ({"d.parquet": b"nope"}, "d.parquet: cannot be loaded by datasets (ArrowInvalid", BOTH),
    "parquet_no_text": ({"d.parquet": _parquet(body=["x"])}, "d.parquet: no 'text' column", BOTH),
    "parquet_int_text": ({"d.parquet": _parquet(text=[1, 2])}, "d.parquet: column 'text' is not a string", BOTH),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_named(cache, tmp_path, case):
    """Refusing checks say so in one line starting with file(:line); the others accept (preflight reads less)."""
    files, start, refused_by, *folder = BAD_DATA[case]
    _write(tmp_path, files)
    path = tmp_path / (folder[0] if folder else start.split(":")[0])
    checks = {"check_dataset": lambda: data.check_dataset("local", str(path)),
              "preflight": lambda: data.preflight(_cfg("local", path)),
              "load_local_text": lambda: data.load_local_text(str(path))}
    for name, check in checks.items():
        if name not in refused_by:
            check()
            continue
        with pytest.raises(UserError) as e:
            check()
        assert str(e.value).startswith(f"{tmp_path}/{start}") and "\n" not in str(e.value), (name, str(e.value))


#: id: (--training.dataset, --training.dataset_path, tokenizer folder files (None: embedded), part of the message).
BAD_CONFIG = {
    "unknown_name": ("c4_tset", None, None, "Unknown dataset 'c4_tset' (--training.dataset). Valid names: "
                                            "c4, c4_test, c4_validation, local. Did you mean 'c4_test'?"),
    "local_without_path": ("local", None, None, "Dataset 'local' needs a file or folder: set --training.dataset_path"),
    "c4_missing_path": ("c4", "nope.jsonl", None, "{tmp}/nope.jsonl: does not exist (--training.dataset_path)"),
    "c4_test_missing_path": ("c4_test", "nope", None, "{tmp}/nope: does not exist (--training.dataset_path)"),
    "missing_tokenizer": ("c4_test", None, "absent", "--model.hf_assets_path {tmp}/tok: this tokenizer folder does "
                                                     "not exist"),
    "empty_tokenizer": ("c4_test", None, {}, "--model.hf_assets_path {tmp}/tok: contains none of tokenizer.json"),
    "sentencepiece_only": ("c4_test", None, {"tokenizer.model": "\0"}, "(tokenizer.model alone, a SentencePiece"),
    "bad_tokenizer_config": ("c4_test", None, {"tokenizer.json": "{}", "tokenizer_config.json": '{"a": 1,\n "b": }\n'},
                             "{tmp}/tok/tokenizer_config.json:2: not valid JSON (Expecting value, column 7)"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIG))
def test_bad_config_named(tmp_path, case):
    """Preflight names the flag or file in <= 2 lines; check_dataset / resolve_tokenizer_path say the same."""
    name, path, tokenizer_files, part = BAD_CONFIG[case]
    part, path, tok = part.format(tmp=tmp_path), path and tmp_path / path, tmp_path / "tok"
    if isinstance(tokenizer_files, dict):
        tok.mkdir()
        _write(tok, tokenizer_files)
    with pytest.raises(UserError) as e:
        data.preflight(_cfg(name, path, tok if tokenizer_files is not None else "embedded"))
    assert part in str(e.value) and len(str(e.value).splitlines()) <= 2, str(e.value)
    with pytest.raises(UserError) as e:
        if tokenizer_files is None:
            data.check_dataset(name, path and str(path))
        else:
            data.resolve_tokenizer_path(str(tok), VOCAB)
    assert part in str(e.value), str(e.value)


def test_preflight_accepts_defaults_and_good_tokenizers(tmp_path, monkeypatch, capsys, caplog):
    """The debug config passes the pre-check without torchtitan's missing-folder warning; so do good inputs."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(REPO)
    assert config._check_main(["--job.config_file", DEBUG]) == 0
    assert "HF assets path" not in "".join(capsys.readouterr()) + caplog.text
    for name in ("c4_test", "C4_TEST", "c4", "c4_validation"):
        data.check_dataset(name, None)
    for tokenizer in (None, "", "embedded"):
        data.preflight(_cfg(tokenizer=tokenizer))
    _write(tok := tmp_path / "tok", {"tokenizer.json": "{}"})
    data.preflight(_cfg(tokenizer=tok))
    assert data.resolve_tokenizer_path(str(tok), VOCAB) == str(tok)


@_early.job("bad_line_deep_in_file")
def _bad_line_runs(tmp, env):
    """A forked rank and run_train.sh's two torchrun ranks on a null 'text' at line 2000: ``(the file, [results])``."""
    (path := tmp / "docs.jsonl").write_text(_lines(2500, 2000, '{"text": null}'))  # loaded whole before step 1
    small = ["--training.dataset_path", str(path), *SMALL, "--compile.inductor_compilation", "none"]
    return path, [run_debug(tmp / f"run{forked}", small, steps=3, forked=forked, ngpu=1 if forked else 2, env=env)
                  for forked in (True, False)]


@_early.uses("bad_line_deep_in_file")
def test_training_stops_at_bad_line_deep_in_file():
    """A null 'text' on line 2000 (past preflight) stops forked and torchrun ranks: one `error: file:line`, exit 2."""
    path, runs = _early.result("bad_line_deep_in_file")
    needle = f"error: {path}:2000: 'text' is null"
    for r in runs:
        text = r.stdout + r.stderr
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in text, text[-3000:]  # a user error: 2
        assert sum(needle in line for line in r.stderr.splitlines()) == 1
