"""Tests for graph_trainer.data: embedded corpus, tokenizer, dataset registry."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from graph_trainer import data
from graph_trainer.errors import UserError

VOCAB = 2048


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache dir (and HF datasets cache) shared by the tests of this module."""
    import datasets

    root = tmp_path_factory.mktemp("gt_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPH_TRAINER_CACHE", str(root))
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf"))
        data.register_datasets()  # re-point c4_test at this cache
        yield root
    data.register_datasets()


@pytest.fixture(scope="module")
def tokenizer(cache):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(data.resolve_tokenizer_path(None, VOCAB))


def _read_jsonl_folder(folder: Path) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted(folder.glob("*.jsonl"))
        for line in f.read_text(encoding="utf-8").splitlines()
    ]


# --------------------------------------------------------------------------- #
# corpus
# --------------------------------------------------------------------------- #


def test_corpus_is_real_english(cache):
    folder = data.ensure_corpus()
    assert folder == cache / "corpus_v1" and folder.is_dir()
    records = _read_jsonl_folder(folder)
    assert len(records) >= 300
    assert all(set(r) == {"text"} and r["text"].strip() for r in records)
    text = " ".join(r["text"] for r in records)
    assert len(text) > 500_000
    words = text.lower().split()
    for common in ("the", "and", "is", "of", "function", "object"):
        assert words.count(common) > 100, common
    # Cached: a second call does not rebuild.
    mtime = (folder / "part-0000.jsonl").stat().st_mtime_ns
    assert data.ensure_corpus() == folder
    assert (folder / "part-0000.jsonl").stat().st_mtime_ns == mtime
    assert not list(cache.glob(".corpus_v1.*[!k]"))  # no leftover tmp folders


# --------------------------------------------------------------------------- #
# tokenizer
# --------------------------------------------------------------------------- #


def test_tokenizer_roundtrip_and_specials(cache, tokenizer):
    assert tokenizer.get_vocab_size() == VOCAB
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id
    assert tokenizer.token_to_id(data.BOS_TOKEN) == tokenizer.bos_id
    assert tokenizer.token_to_id(data.EOS_TOKEN) == tokenizer.eos_id
    for text in (
        "The quick brown fox jumps over the lazy dog.",
        "def f(x):\n    return x ** 2  # square\n",
        "naïve café — 日本語 🙂",
    ):
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert all(0 <= i < VOCAB for i in ids)
        assert tokenizer.decode(ids) == text
    # Trained on English: common words are single tokens, text compresses well.
    english = "The function returns the value of the object and the list."
    assert len(tokenizer.encode(english)) < len(english) / 3
    config = json.loads((cache / f"tokenizer_{VOCAB}" / "tokenizer_config.json").read_text())
    assert config["bos_token"] == data.BOS_TOKEN and config["eos_token"] == data.EOS_TOKEN
    assert config["add_bos_token"] is True and config["add_eos_token"] is True


def test_embedded_aliases(cache, tokenizer):
    expected = str(cache / f"tokenizer_{VOCAB}")
    for alias in (None, "", "embedded"):
        assert data.resolve_tokenizer_path(alias, VOCAB) == expected


def test_tokenizer_is_deterministic(cache, tokenizer, tmp_path, monkeypatch):
    first = (cache / f"tokenizer_{VOCAB}" / "tokenizer.json").read_bytes()
    monkeypatch.setenv("GRAPH_TRAINER_CACHE", str(tmp_path))
    second = (data.ensure_tokenizer(VOCAB) / "tokenizer.json").read_bytes()
    assert first == second


def test_tokenizer_pads_large_vocab(tmp_path, monkeypatch):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    monkeypatch.setenv("GRAPH_TRAINER_CACHE", str(tmp_path))
    tok = HuggingFaceTokenizer(data.resolve_tokenizer_path("embedded", 32768))
    assert tok.get_vocab_size() == 32768
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_tokenizer_too_small_vocab(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPH_TRAINER_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="at least 258"):
        data.ensure_tokenizer(100)


def test_concurrent_builders_agree(tmp_path):
    """Several processes racing on a cold cache all get the same folder."""
    code = (
        "from graph_trainer import data;"
        "print(data.ensure_corpus(), data.ensure_tokenizer(512))"
    )
    env = {**__import__("os").environ, "GRAPH_TRAINER_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "corpus_v1",
        "tokenizer_512",
    ]
    assert len(_read_jsonl_folder(tmp_path / "corpus_v1")) == len(data.corpus_documents())


# --------------------------------------------------------------------------- #
# datasets through torchtitan
# --------------------------------------------------------------------------- #


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_c4_test_is_embedded_corpus(cache, tokenizer):
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

    data.register_datasets()
    assert DATASETS["c4_test"].path == str(cache / "corpus_v1")
    assert DATASETS["c4"].path == "allenai/c4"
    ds = HuggingFaceTextDataset("c4_test", None, tokenizer, seq_len=64)
    samples = _take(ds, 3)
    for inputs, labels in samples:
        assert inputs["input"].shape == (64,) and labels.shape == (64,)
        assert (inputs["input"][1:] == labels[:-1]).all()
    assert samples[0][0]["input"][0].item() == tokenizer.bos_id


def test_build_text_dataloader(cache, tokenizer):
    from torchtitan.config import JobConfig
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    data.register_datasets()
    job = JobConfig()
    job.training.dataset, job.training.dataset_path = "c4_test", None
    job.training.local_batch_size, job.training.seq_len = 2, 32
    loader = build_text_dataloader(1, 0, tokenizer, job)
    inputs, labels = next(iter(loader))
    assert inputs["input"].shape == (2, 32) and labels.shape == (2, 32)


@pytest.fixture
def local_files(tmp_path):
    """A JSONL file, a Parquet file and a folder of JSONL files with a text column."""
    from datasets import Dataset

    texts = [f"Document number {i} talks about the weather and the sea." for i in range(20)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    parquet = tmp_path / "docs.parquet"
    Dataset.from_dict({"text": texts}).to_parquet(str(parquet))
    folder = tmp_path / "folder"
    folder.mkdir()
    for k in range(2):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[k * 10 : (k + 1) * 10])
        (folder / f"part-{k}.jsonl").write_text(lines)
    (folder / "README.md").write_text("ignored")
    return texts, {"jsonl": jsonl, "parquet": parquet, "folder": folder}


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "folder"])
def test_local_files_load(cache, tokenizer, local_files, kind):
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    texts, paths = local_files
    path = str(paths[kind])
    assert data.load_local_text(path)["text"] == texts
    data.register_datasets()
    for name in ("local", "c4_test", "c4"):  # any name loads a local dataset_path
        data.check_dataset(name, path)
        ds = HuggingFaceTextDataset(name, path, tokenizer, seq_len=16)
        inputs, labels = _take(ds, 2)[0]
        assert inputs["input"].shape == (16,) and labels.shape == (16,)
        decoded = tokenizer.decode(inputs["input"].tolist())
        assert decoded.startswith(texts[0][:10])


# --------------------------------------------------------------------------- #
# bad input: one line naming the file (and line), from preflight and at load
# --------------------------------------------------------------------------- #

REPO = Path(__file__).resolve().parent.parent
DEBUG_TOML = REPO / "train_configs" / "debug_model.toml"


def _cfg(dataset="c4_test", path=None, tokenizer="embedded"):
    """The three fields preflight reads, as a parsed JobConfig holds them."""
    from types import SimpleNamespace

    return SimpleNamespace(
        training=SimpleNamespace(dataset=dataset, dataset_path=None if path is None else str(path)),
        model=SimpleNamespace(hf_assets_path=None if tokenizer is None else str(tokenizer)),
    )


def _lines(n: int = 10, bad_line: int | None = 3, bad: str = "this is not json: true") -> str:
    """``n`` lines of ``{"text": ...}``, line ``bad_line`` (1-based) replaced by ``bad``."""
    good = (json.dumps({"text": f"Line {i} is about the sea."}) for i in range(1, n + 1))
    return "".join((bad if i == bad_line else line) + "\n" for i, line in enumerate(good, 1))


def _parquet(**columns) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue().to_pybytes()


ALL, BOTH, LOAD = {"check_dataset", "preflight", "load_local_text"}, {"preflight", "load_local_text"}, {"load_local_text"}
#: id: (files written under tmp_path, --training.dataset_path, the message's start after ``tmp_path/``,
#: the checks that refuse it: check_dataset (path only), preflight (first records), load_local_text).
BAD_DATA = {
    "missing": ({}, "nope.jsonl", "nope.jsonl: does not exist", ALL),
    "not_data": ({"notes.txt": "hello"}, "notes.txt", "notes.txt: is not a .json", ALL),
    "no_data_files": ({"d/notes.txt": "hello"}, "d", "d: contains no .json", ALL),
    "json_and_parquet": ({"d/a.jsonl": _lines(1, None), "d/b.parquet": b""}, "d", "d: mixes JSON and Parquet", ALL),
    "garbage": ({"d.jsonl": _lines()}, "d.jsonl", "d.jsonl:3: not valid JSON (Expecting value", BOTH),
    "truncated": ({"d.jsonl": _lines(bad='{"text": "cut off')}, "d.jsonl", "d.jsonl:3: not valid JSON (Unterminated", BOTH),
    "not_utf8": ({"d.jsonl": _lines(bad='{"text": "?"}').encode().replace(b"?", b"\xff")}, "d.jsonl",
                 "d.jsonl:3: not valid JSON ('utf-8' codec can't decode byte 0xff", BOTH),
    "empty_line": ({"d.jsonl": _lines(bad="")}, "d.jsonl", "d.jsonl:3: empty line", BOTH),
    "no_text": ({"d.jsonl": _lines(bad='{"body": "x"}')}, "d.jsonl", "d.jsonl:3: no 'text' field in {\"body\"", BOTH),
    "null_text": ({"d.jsonl": _lines(bad='{"text": null}')}, "d.jsonl", "d.jsonl:3: 'text' is null, not a string", BOTH),
    "number_text": ({"d.jsonl": _lines(bad='{"text": 7}')}, "d.jsonl", "d.jsonl:3: 'text' is 7, not a string", BOTH),
    "deep": ({"d.jsonl": _lines(2500, 2000)}, "d.jsonl", "d.jsonl:2000: not valid JSON", BOTH),
    "deep_null_text": ({"d.jsonl": _lines(2500, 2000, '{"text": null}')}, "d.jsonl", "d.jsonl:2000: 'text' is null", LOAD),
    "gzipped": ({"d.jsonl.gz": gzip.compress(_lines().encode())}, "d.jsonl.gz", "d.jsonl.gz:3: not valid JSON", BOTH),
    "second_file": ({"d/a.jsonl": _lines(3, None), "d/b.jsonl": _lines(3, 1)}, "d", "d/b.jsonl:1: not valid JSON", BOTH),
    "empty_first_file": ({"d/a.jsonl": "", "d/b.jsonl": _lines(3, None)}, "d", "d/a.jsonl: holds no records", BOTH),
    "array_syntax": ({"d.json": '[\n  {"text": "a"},\n  {"text": "b"\n'}, "d.json", "d.json:4: not valid JSON", BOTH),
    "array_record": ({"d.json": '[{"text": "a"}, {"text": 2}]'}, "d.json",
                     "d.json: record 2 of the JSON array: 'text' is 2", LOAD),
    "no_text_column": ({"d.jsonl": '{"body": "x"}\n'}, "d.jsonl", "d.jsonl: no 'text' column (columns: body)", BOTH),
    "parquet_corrupt": ({"d.parquet": b"nope"}, "d.parquet", "d.parquet: cannot be loaded by datasets (ArrowInvalid", BOTH),
    "parquet_no_text": ({"d.parquet": lambda: _parquet(body=["x"])}, "d.parquet", "d.parquet: no 'text' column", BOTH),
    "parquet_int_text": ({"d.parquet": lambda: _parquet(text=[1, 2])}, "d.parquet",
                         "d.parquet: column 'text' is not a string", BOTH),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_named(cache, tmp_path, case):
    """Each check that refuses the input says so in one line starting with the file (and line);
    the others accept it (preflight reads the first records, the loader every record)."""
    files, path, start, refused_by = BAD_DATA[case]
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        content = content() if callable(content) else content
        getattr(tmp_path / name, "write_bytes" if isinstance(content, bytes) else "write_text")(content)
    path = tmp_path / path
    checks = {"check_dataset": lambda: data.check_dataset("local", str(path)),
              "preflight": lambda: data.preflight(_cfg("local", path)),
              "load_local_text": lambda: data.load_local_text(str(path))}
    for name, check in checks.items():
        if name not in refused_by:
            check()
            continue
        with pytest.raises(UserError) as e:
            check()
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path}/{start}") and "\n" not in msg, (name, msg)


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
    """Preflight names the flag or file in at most two lines; check_dataset (dataset cases) and
    resolve_tokenizer_path (tokenizer cases) give the same message."""
    name, path, tokenizer_files, part = BAD_CONFIG[case]
    part = part.format(tmp=tmp_path)
    tok = tmp_path / "tok"
    if isinstance(tokenizer_files, dict):
        tok.mkdir()
        for file, text in tokenizer_files.items():
            (tok / file).write_text(text)
    path = path and tmp_path / path
    with pytest.raises(UserError) as e:
        data.preflight(_cfg(name, path, tok if tokenizer_files is not None else "embedded"))
    assert part in str(e.value) and len(str(e.value).splitlines()) <= 2, str(e.value)
    with pytest.raises(UserError) as e:
        if tokenizer_files is None:
            data.check_dataset(name, path and str(path))
        else:
            data.resolve_tokenizer_path(str(tok), VOCAB)
    assert part in str(e.value), str(e.value)


def test_dataset_names_match_registry(cache):
    from torchtitan.hf_datasets.text_datasets import DATASETS

    data.register_datasets()
    assert sorted(data.DATASET_NAMES) == sorted(DATASETS)


def test_preflight_accepts_defaults_and_good_files(local_files, tmp_path):
    from graph_trainer.config import parse_args

    data.preflight(parse_args(["--job.config_file", str(DEBUG_TOML)]))
    for name in ("c4_test", "C4_TEST", "c4", "c4_validation"):
        data.check_dataset(name, None)
    for tokenizer in (None, "", "embedded"):
        data.preflight(_cfg(tokenizer=tokenizer))
    _, paths = local_files
    for name in ("local", "c4_test", "c4"):
        for path in paths.values():
            data.preflight(_cfg(name, path))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    data.preflight(_cfg(tokenizer=tok))
    assert data.resolve_tokenizer_path(str(tok), VOCAB) == str(tok)


def test_preflight_imports_no_torchtitan(tmp_path):
    """preflight runs before torchrun: it imports datasets (whose streaming loader imports
    torch) but not torchtitan."""
    good = tmp_path / "good.jsonl"
    good.write_text(_lines(10, None))
    code = (
        "import sys\n"
        "from types import SimpleNamespace as N\n"
        "from graph_trainer import data\n"
        f"data.preflight(N(training=N(dataset='local', dataset_path={str(good)!r}),"
        " model=N(hf_assets_path='embedded')))\n"
        "print('torchtitan' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.slow
def test_training_stops_at_bad_line_deep_in_file(tmp_path):
    """A record past what preflight checks (a null 'text' on line 2000) stops the trainer with one
    `error: file:line` line, exit 2, no traceback; through run_train.sh (torchrun) too. The
    trainer's own entry point runs in a process forked from tests/_launch.py's server."""
    from _launch import train_ranks  # tests/ is on sys.path

    path = tmp_path / "docs.jsonl"
    path.write_text(_lines(2500, 2000, '{"text": null}'))
    # The local file is loaded whole before step 1, so few steps reach every line.
    flags = ["--training.dataset_path", str(path), "--training.steps", "3", "--training.seq_len", "64",
             "--training.local_batch_size", "2", "--compile.inductor_compilation", "none"]
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    needle = f"error: {path}:2000: 'text' is null"
    direct = train_ranks(1, ["--job.dump_folder", str(tmp_path / "direct"), *flags], tmp_path / "direct_logs")
    text = direct.stdout + direct.stderr
    assert direct.returncode == 2, text[-3000:]
    assert needle in direct.stderr and "Traceback" not in text, text[-3000:]
    launched = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "launched"), *flags],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )
    text = launched.stdout + launched.stderr
    assert launched.returncode == 2, text[-3000:]  # run_train.sh: a worker's user error is exit 2
    assert needle in launched.stderr and "Traceback" not in text, text[-3000:]
    assert sum(needle in line for line in launched.stderr.splitlines()) == 1
