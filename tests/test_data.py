"""Tests for graph_trainer.data: embedded corpus, tokenizer, dataset registry."""

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
# helpful errors
# --------------------------------------------------------------------------- #


def test_check_dataset_accepts_known_names(cache):
    for name in ("c4_test", "C4_TEST", "c4", "c4_validation"):
        data.check_dataset(name, None)


def test_unknown_dataset_name(cache):
    with pytest.raises(UserError) as e:
        data.check_dataset("c5", None)
    msg = str(e.value)
    assert "'c5'" in msg and "c4_test" in msg and "local" in msg


def test_missing_dataset_path(cache, tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    for name in ("c4_test", "local", "c4"):
        with pytest.raises(UserError) as e:
            data.check_dataset(name, missing)
        assert missing in str(e.value) and "--training.dataset_path" in str(e.value)


def test_local_without_path(cache):
    with pytest.raises(UserError, match="--training.dataset_path"):
        data.check_dataset("local", None)


def test_unusable_dataset_paths(cache, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="is not a .json"):
        data.check_dataset("local", str(tmp_path / "notes.txt"))
    with pytest.raises(UserError, match="contains no .json"):
        data.check_dataset("local", str(tmp_path))
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(UserError, match="mixes JSON and Parquet"):
        data.load_local_text(str(tmp_path))
    (tmp_path / "body.jsonl").write_text('{"body": "no text key"}\n')
    with pytest.raises(UserError, match="no 'text' column"):
        data.load_local_text(str(tmp_path / "body.jsonl"))


def test_missing_tokenizer_folder(tmp_path):
    missing = str(tmp_path / "no_such_tokenizer")
    with pytest.raises(UserError) as e:
        data.resolve_tokenizer_path(missing, VOCAB)
    assert missing in str(e.value) and "embedded" in str(e.value)
    with pytest.raises(UserError, match="contains none of tokenizer.json"):
        data.resolve_tokenizer_path(str(tmp_path), VOCAB)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert data.resolve_tokenizer_path(str(tmp_path), VOCAB) == str(tmp_path)


# --------------------------------------------------------------------------- #
# preflight: data and tokenizer checked before anything starts
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


def _preflight_error(cfg) -> str:
    with pytest.raises(UserError) as e:
        data.preflight(cfg)
    msg = str(e.value)
    assert 1 <= len(msg.splitlines()) <= 2, msg
    return msg


def _jsonl(path: Path, n: int, bad_line: int | None = None, bad: str = "this is not json: true") -> Path:
    """``n`` lines of ``{"text": ...}``, line ``bad_line`` (1-based) replaced by ``bad``."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(1, n + 1):
            f.write((bad if i == bad_line else json.dumps({"text": f"Line {i} is about the sea."})) + "\n")
    return path


def test_preflight_rejects_missing_dataset_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    for name in ("c4_test", "local", "c4"):
        msg = _preflight_error(_cfg(name, missing))
        assert str(missing) in msg and "--training.dataset_path" in msg
    msg = _preflight_error(_cfg("local"))
    assert "--training.dataset_path" in msg


def test_preflight_rejects_bad_jsonl_line(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", 10, bad_line=2, bad='{"text": tru')
    msg = _preflight_error(_cfg("c4_test", bad))
    assert msg.startswith(f"{bad}:2: not valid JSON") and "--training.dataset_path" in msg
    no_text = _jsonl(tmp_path / "no_text.jsonl", 10, bad_line=3, bad='{"body": "x"}')
    assert _preflight_error(_cfg("local", no_text)).startswith(f"{no_text}:3: no 'text' field")
    # A folder: its files are read too.
    folder = tmp_path / "folder"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", 3)
    _jsonl(folder / "b.jsonl", 3, bad_line=1)
    assert _preflight_error(_cfg("local", folder)).startswith(f"{folder / 'b.jsonl'}:1: not valid JSON")


def test_preflight_rejects_invalid_json_array(tmp_path):
    bad = tmp_path / "docs.json"
    bad.write_text('[\n  {"text": "a"},\n  {"text": "b"\n')
    msg = _preflight_error(_cfg("local", bad))
    assert msg.startswith(f"{bad}:") and "not valid JSON" in msg
    ints = tmp_path / "ints.json"
    ints.write_text('[{"text": "a"}, {"text": 2}]')
    assert "record 2 of the JSON array: 'text' is a number" in _preflight_error(_cfg("local", ints))


def test_preflight_rejects_bad_tokenizer_folder(tmp_path):
    empty = tmp_path / "tok"
    empty.mkdir()
    msg = _preflight_error(_cfg(tokenizer=empty))
    assert msg.startswith(f"--model.hf_assets_path {empty}: contains none of tokenizer.json")
    assert "embedded" in msg
    missing = tmp_path / "missing"
    assert str(missing) in _preflight_error(_cfg(tokenizer=missing))
    # tokenizer.model alone (SentencePiece) is not loadable by HuggingFaceTokenizer.
    (empty / "tokenizer.model").write_bytes(b"\0")
    assert "SentencePiece" in _preflight_error(_cfg(tokenizer=empty))
    with pytest.raises(UserError, match="SentencePiece"):
        data.resolve_tokenizer_path(str(empty), VOCAB)
    (empty / "tokenizer.json").write_text("{}")
    (empty / "tokenizer_config.json").write_text('{"bos_token": "<s>",\n "eos_token": }\n')
    assert _preflight_error(_cfg(tokenizer=empty)).startswith(f"{empty / 'tokenizer_config.json'}:2: not valid JSON")


def test_preflight_rejects_unknown_dataset():
    msg = _preflight_error(_cfg("c4_tset"))
    assert "'c4_tset'" in msg and "--training.dataset" in msg and "Did you mean 'c4_test'" in msg


def test_dataset_names_match_registry(cache):
    from torchtitan.hf_datasets.text_datasets import DATASETS

    data.register_datasets()
    assert sorted(data.DATASET_NAMES) == sorted(DATASETS)


def test_preflight_accepts_defaults_and_good_files(local_files, tmp_path):
    from graph_trainer.config import parse_args

    data.preflight(parse_args(["--job.config_file", str(DEBUG_TOML)]))
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


def test_preflight_imports_neither_torch_nor_torchtitan(tmp_path):
    good = _jsonl(tmp_path / "good.jsonl", 10)
    code = (
        "import sys\n"
        "from types import SimpleNamespace as N\n"
        "from graph_trainer import data\n"
        f"data.preflight(N(training=N(dataset='local', dataset_path={str(good)!r}),"
        " model=N(hf_assets_path='embedded')))\n"
        "print(sorted(m for m in ('torch', 'torchtitan', 'datasets') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# --------------------------------------------------------------------------- #
# bad records deep in a file: named with file and line when the dataset loads
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("this is not json: true", "not valid JSON"),
        ('{"text": "cut off', "not valid JSON"),
        ('{"body": "x"}', "no 'text' field"),
        ('{"text": null}', "'text' is null"),
        ('{"text": 7}', "'text' is a number"),
        ("", "empty line"),
    ],
    ids=["garbage", "truncated", "no_text", "null_text", "number_text", "empty"],
)
def test_bad_line_deep_in_file_named_on_load(cache, tmp_path, bad, problem):
    good = _jsonl(tmp_path / "good.jsonl", 2500)  # control: the same file without the bad line
    assert data.load_local_text(str(good))["text"][1999] == "Line 2000 is about the sea."
    path = _jsonl(tmp_path / "docs.jsonl", 2500, bad_line=2000, bad=bad)
    data.preflight(_cfg("local", path))  # past the records preflight reads
    with pytest.raises(UserError) as e:
        data.load_local_text(str(path))
    assert str(e.value).startswith(f"{path}:2000: {problem}"), str(e.value)


def test_empty_first_file_named(cache, tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text("")
    _jsonl(folder / "b.jsonl", 3)
    with pytest.raises(UserError, match=f"{folder / 'a.jsonl'}: holds no records"):
        data.load_local_text(str(folder))
    assert _preflight_error(_cfg("local", folder)).startswith(f"{folder / 'a.jsonl'}: holds no records")


@pytest.mark.slow
def test_training_stops_at_bad_line_deep_in_file(tmp_path):
    """A corrupt line past what preflight reads stops the trainer with one `error: file:line`
    line, exit 2, no traceback; through run_train.sh (torchrun) too. The trainer's own entry
    point runs in a process forked from tests/_launch.py's server."""
    from _launch import train_ranks  # tests/ is on sys.path

    path = _jsonl(tmp_path / "docs.jsonl", 2500, bad_line=2000)
    # The local file is loaded whole before step 1, so few steps reach every line.
    flags = ["--training.dataset_path", str(path), "--training.steps", "3", "--training.seq_len", "64",
             "--training.local_batch_size", "2", "--compile.inductor_compilation", "none"]
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    needle = f"error: {path}:2000: not valid JSON"
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
