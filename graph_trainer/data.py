"""Offline data: an embedded English corpus (``pydoc_data`` help topics and stdlib docstrings), a BPE tokenizer trained
on it, built once under :func:`cache_dir`, and torchtitan dataset registration."""

import ast
import difflib
import fcntl
import functools
import gzip
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from itertools import islice
from pathlib import Path
from typing import Any, Callable

from graph_trainer.errors import UserError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
_CORPUS_NAME = "corpus_v1"  # bump when the corpus recipe changes
_CORPUS_SHARDS = 4
_DOC_CHARS = 2000  # documents are paragraphs merged up to about this size
#: The names ``--training.dataset`` accepts (case-insensitive), as registered in torchtitan's ``DATASETS``.
DATASET_NAMES = ("c4", "c4_test", "c4_validation", "local")
#: Files torchtitan's ``HuggingFaceTokenizer`` loads a tokenizer from (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
_PREFLIGHT_RECORDS = 5  # records whose values preflight() checks per data file
_PREFLIGHT_FILES = 8  # data files of a folder read by preflight()
_FIX = "fix or delete it (--training.dataset_path wants JSON objects with a 'text' string, one per line)"


def cache_dir() -> Path:
    """The cache folder (not created): ``$GRAPH_TRAINER_CACHE``, else ``~/.cache/graph_trainer``."""
    env = os.environ.get("GRAPH_TRAINER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "graph_trainer"


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Create folder ``final`` with ``build(tmp)`` once: flock-serialized, built beside it and renamed."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if final.is_dir():  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            build(tmp)
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # else: lost a race on a filesystem without working flock
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _chunk(text: str, size: int = _DOC_CHARS) -> list[str]:
    """Split ``text`` at blank lines into pieces of about ``size`` characters."""
    chunks, cur = [], ""
    for para in filter(str.strip, text.split("\n\n")):
        cur = "\n\n".join(filter(None, (cur, para.strip("\n"))))
        if len(cur) >= size:
            chunks.append(cur)
            cur = ""
    return chunks + [cur] if cur else chunks


def _stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """One text per top-level stdlib module: its docstrings of >= min_chars."""
    texts = []
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, defs)]
        if docs := [d for n in nodes if (d := ast.get_docstring(n)) and len(d) >= min_chars]:
            texts.append("\n\n".join(docs))
    return texts


def corpus_documents() -> list[str]:
    """The embedded corpus in a fixed order: several hundred English documents of about 2 KB."""
    from pydoc_data.topics import topics

    return [doc for text in [topics[k] for k in sorted(topics)] + _stdlib_docstrings() for doc in _chunk(text)]


def corpus_dir() -> Path:
    """Where the embedded corpus lives (it may not exist yet): ``<cache>/corpus_v1``."""
    return cache_dir() / _CORPUS_NAME


def ensure_corpus() -> Path:
    """Build the embedded corpus if needed; returns its folder of ``part-*.jsonl`` (``{"text": ...}`` lines)."""

    def build(tmp: Path) -> None:
        docs = corpus_documents()
        per_shard = -(-len(docs) // _CORPUS_SHARDS)
        for i in range(_CORPUS_SHARDS):
            lines = [json.dumps({"text": doc}, ensure_ascii=False) for doc in docs[i * per_shard : (i + 1) * per_shard]]
            (tmp / f"part-{i:04d}.jsonl").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")

    return _build_once(corpus_dir(), build)


def ensure_tokenizer(vocab_size: int) -> Path:
    """Train (once, deterministically) a byte-level BPE tokenizer of exactly ``vocab_size`` tokens (BOS, EOS and
    reserved padding tokens included) on the embedded corpus; returns ``<cache>/tokenizer_<vocab_size>``. Raises
    UserError: ``vocab_size`` < 258 (256 bytes + BOS + EOS)."""
    if vocab_size < 258:
        raise UserError(f"The embedded tokenizer needs a vocab size of at least 258 (256 bytes plus BOS and EOS), got "
                        f"{vocab_size}. Set the model's vocab_size to 258 or more, or point --model.hf_assets_path at "
                        f"your own tokenizer folder.")

    def build(tmp: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS_TOKEN, EOS_TOKEN],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(corpus_documents(), trainer=trainer)
        if (missing := vocab_size - tok.get_vocab_size()) > 0:
            tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(missing)])
        tok.save(str(tmp / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
                  "add_bos_token": True, "add_eos_token": True, "clean_up_tokenization_spaces": False}
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    return _build_once(cache_dir() / f"tokenizer_{vocab_size}", build)


def check_tokenizer_folder(hf_assets_path: str) -> Path:
    """``--model.hf_assets_path``, ``~`` expanded, checked to hold a tokenizer torchtitan can load. Raises
    UserError: missing, a file, none of :data:`TOKENIZER_FILES`, bad ``tokenizer_config.json``."""
    flag = f"--model.hf_assets_path {hf_assets_path}"
    embedded = "or set --model.hf_assets_path embedded for the built-in offline tokenizer."
    path = Path(hf_assets_path).expanduser()
    if not path.exists():
        raise UserError(f"{flag}: this tokenizer folder does not exist. Download the model's tokenizer there "
                        f"(torchtitan's scripts/download_hf_assets.py --assets tokenizer), {embedded}")
    if not path.is_dir():
        raise UserError(f"{flag}: is a file, not a tokenizer folder. Point it at the folder holding "
                        f"tokenizer.json, {embedded}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        found = sorted(p.name for p in path.iterdir())
        listed = ", ".join(found[:10]) + (", ..." if len(found) > 10 else "") if found else "nothing"
        sentencepiece = (" (tokenizer.model alone, a SentencePiece model, is not loadable by "
                         "torchtitan's HuggingFaceTokenizer)" if "tokenizer.model" in found else "")
        raise UserError(f"{flag}: contains none of {', '.join(TOKENIZER_FILES)} (found: {listed}){sentencepiece}.\n"
                        f"Put your model's tokenizer files in this folder, {embedded}")
    if (config := path / "tokenizer_config.json").is_file():
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise UserError(f"{_json_error(config, e)} ({flag}). Fix the file, or delete it to let torchtitan "
                            f"infer the special tokens.") from None
    return path


def resolve_tokenizer_path(hf_assets_path: str | None, vocab_size: int) -> str:
    """The tokenizer folder for ``--model.hf_assets_path``: None / "" / "embedded": the built-in one of
    ``vocab_size`` tokens, else the folder, checked (UserError: :func:`check_tokenizer_folder`)."""
    embedded = not hf_assets_path or hf_assets_path == "embedded"
    return str(ensure_tokenizer(vocab_size) if embedded else check_tokenizer_folder(hf_assets_path))


def _builder_for(file: Path) -> str | None:
    """The ``datasets`` builder for a data file (.json/.jsonl, gzipped or not, .parquet), or None."""
    name = file.name.lower()
    if name.removesuffix(".gz").endswith((".json", ".jsonl")):
        return "json"
    return "parquet" if name.endswith(".parquet") else None


def _data_files(path: str) -> tuple[str, list[str]]:
    """(builder, sorted data files) of a file or a folder's top-level files (``datasets``' errors name no flag). Raises
    UserError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{path}: does not exist (--training.dataset_path). Point it at a .json/.jsonl/.parquet "
                        f"file or a folder of them with a 'text' column, or drop --training.dataset_path to use "
                        f"the built-in corpus (--training.dataset c4_test).")
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    builders = {f: b for f in files if (b := _builder_for(f))}
    if len(kinds := set(builders.values())) != 1:
        problem = ("is not a .json, .jsonl(.gz) or .parquet file" if p.is_file() else
                   "mixes JSON and Parquet files" if kinds else "contains no .json, .jsonl(.gz) or .parquet files")
        raise UserError(f"{path}: {problem} (--training.dataset_path). Point it at one such file, or a folder "
                        f"whose top-level data files are all JSON or all Parquet, with a 'text' column.")
    return kinds.pop(), [str(f) for f in builders]


def _json_error(file: Path | str, e: ValueError, lineno: int | None = None) -> str:
    """``"<file>:<line>: not valid JSON (<reason>)"`` for a JSON or UTF-8 decoding error."""
    line = lineno or getattr(e, "lineno", None)
    reason = f"{e.msg.removesuffix(' at')}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
    return f"{file}{f':{line}' if line else ''}: not valid JSON ({reason})"


def _text_problem(record: Any) -> str | None:
    """What keeps a decoded record from being a document, or None if it has a ``text`` string."""
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return None
    if isinstance(record, dict) and "text" in record:
        return f"'text' is {json.dumps(record['text'])[:40]}, not a string"
    return f"no 'text' field in {json.dumps(record)[:60]}"


def _first_bad_record(file: str) -> str | None:
    """``"<file>:<line>: <problem>"`` for the first record of a JSON (Lines, gzipped or not) file that is no document,
    or None (``datasets``' errors name no line; a null ``text`` loads). Raises OSError, EOFError."""
    with (gzip.open if file.lower().endswith(".gz") else open)(file, "rb") as f:
        lineno = 0
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.lstrip().startswith(b"["):  # one JSON array
                try:
                    records = json.loads(raw + f.read())
                except ValueError as e:
                    return _json_error(file, e)
                for i, record in enumerate(records if isinstance(records, list) else [], 1):
                    if not isinstance(record, str) and (problem := _text_problem(record)):
                        return f"{file}: record {i} of the JSON array: {problem}"
                return None
            if not raw.strip():
                return f"{file}:{lineno}: empty line"
            try:
                if problem := _text_problem(json.loads(raw.rstrip(b"\r\n"))):
                    return f"{file}:{lineno}: {problem}"
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                return _json_error(file, e, lineno)
    return None if lineno else f"{file}: holds no records"


def _bad_data(builder: str, files: list[str], label: str, error: Exception | None) -> UserError:
    """The error of a load that raised ``error`` (None: left ``text`` unusable): the first bad JSON record, else the
    loader's error under ``label``."""
    for file in files if builder == "json" else ():
        try:
            if where := _first_bad_record(file):
                return UserError(f"{where}; {_FIX}.")
        except (OSError, EOFError) as e:
            return UserError(f"{file}: cannot be read ({e}) (--training.dataset_path).")
    if error is None:
        return UserError(f"{label}: column 'text' is not a string in every record (--training.dataset_path); "
                         f"store one document per record under 'text'.")
    cause = error.__cause__ or error  # DatasetGenerationError wraps the builder's error
    reason = str(cause).strip().splitlines()[0] if str(cause).strip() else "no reason given"
    return UserError(f"{label}: cannot be loaded by datasets ({type(cause).__name__}: {reason}) "
                     f"(--training.dataset_path); rewrite or remove the file.")


def _load_checked(builder: str, files: list[str], label: str, hf_cache: str | None = None, preview: int | None = None):
    """``load_dataset(builder, data_files=files)`` checked for a ``text`` str column; ``preview``: N rows streamed."""
    from datasets import load_dataset

    log = logging.getLogger("datasets")  # its builders log a failure before raising it; we report it
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        ds = load_dataset(builder, data_files=files, split="train", cache_dir=hf_cache, streaming=preview is not None)
        rows = list(islice(ds, preview)) if preview else []
    except Exception as e:  # noqa: BLE001 - pyarrow / pandas / ujson / datasets errors of every type
        raise _bad_data(builder, files, label, e) from None
    finally:
        log.setLevel(level)
    features = ds.features  # None when streaming a JSON array file
    names = list(features or (rows[0] if rows else {}))
    if "text" not in names:
        raise UserError(f"{label}: no 'text' column (columns: {', '.join(names) or 'none'}) "
                        f"(--training.dataset_path). Store one document per record under the key 'text'.")
    kind = getattr(features["text"], "dtype", None) if features else "string"
    if kind not in ("string", "large_string") or (any(not isinstance(r.get("text"), str) for r in rows) if preview
                                                  else ds.data.column("text").null_count):
        raise _bad_data(builder, files, label, None)
    return ds


def load_local_text(path: str | None, hf_cache: str | None = None):
    """A local JSON / JSONL / Parquet file, or a folder's top-level data files (sorted), as a map-style
    ``datasets.Dataset`` with a ``text`` string per record. Raises UserError: no path, an unusable path or record
    (``<file>:<line>: ...``), no ``text`` column."""
    if path is None:
        raise UserError("Dataset 'local' needs a file or folder: set --training.dataset_path to "
                        "a .json/.jsonl/.parquet file or a folder of them with a 'text' column.")
    return _load_checked(*_data_files(path), path, hf_cache)


def _load_embedded_or_local(path: str | None):
    """``c4_test`` loader: the embedded corpus (built on demand) or a local path."""
    if path is None or Path(path).expanduser() == corpus_dir():
        return load_local_text(str(ensure_corpus()), hf_cache=str(cache_dir() / "hf_datasets"))
    return load_local_text(path)


def _has_data_files(p: Path) -> bool:
    return p.is_file() or (p.is_dir() and any(_builder_for(f) for f in p.iterdir()))


def _local_or_hub(hub_loader: Callable[[str], Any], path: str):
    """A local data file / folder ``path`` loaded locally, else ``hub_loader(path)``."""
    return load_local_text(path) if _has_data_files(Path(path).expanduser()) else hub_loader(path)


def _text(sample: dict[str, Any]) -> str:  # a module function: dataloader workers pickle it
    return sample["text"]


def register_datasets() -> None:
    """Register in torchtitan's ``DATASETS``: ``c4_test`` (the embedded corpus), ``local`` and ``c4`` /
    ``c4_validation`` (hub); every name loads a local ``--training.dataset_path`` locally. Idempotent."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name in ("c4", "c4_validation"):
        cfg = DATASETS[name]
        if getattr(cfg.loader, "func", None) is not _local_or_hub:
            DATASETS[name] = DatasetConfig(cfg.path, functools.partial(_local_or_hub, cfg.loader), cfg.sample_processor)
    DATASETS["c4_test"] = DatasetConfig(str(corpus_dir()), _load_embedded_or_local, _text)
    DATASETS["local"] = DatasetConfig(None, load_local_text, _text)


def check_dataset(name: str, path: str | None, preview: bool = False) -> None:
    """Validate ``--training.dataset`` / ``--training.dataset_path`` before any model is built; ``preview``: also
    stream the first records of a local path's first files through ``datasets``. Raises UserError: an unknown name
    (with the closest valid one), ``local`` without a path, a missing or unusable path; with ``preview``,
    ``<file>:<line>: ...`` for a bad record."""
    key = name.lower()
    if key not in DATASET_NAMES:
        close = difflib.get_close_matches(key, DATASET_NAMES, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise UserError(f"Unknown dataset '{name}' (--training.dataset). Valid names: {', '.join(DATASET_NAMES)}."
                        f"{hint}\nUse c4_test for the built-in offline corpus, or local with --training.dataset_path "
                        f"for your own files.")
    if not path:
        if key == "local":
            load_local_text(None)  # raises the UserError explaining the fix
        return
    p = Path(path).expanduser()
    if (key == "c4_test" and p == corpus_dir()) or (key in ("c4", "c4_validation") and p.is_dir()
                                                     and not _has_data_files(p)):
        return  # the embedded corpus (built on first use), or a local clone of the hub dataset
    builder, files = _data_files(path)
    for i, file in enumerate(files[:_PREFLIGHT_FILES] if preview else []):
        if i == 0 or os.path.getsize(file):  # datasets loads an empty file after the first
            _load_checked(builder, [file], file, preview=_PREFLIGHT_RECORDS)


def preflight(cfg) -> None:
    """Check the data and tokenizer flags of a parsed JobConfig fast, importing no torchtitan (hub
    datasets unchecked). Raises UserError naming the flag and the file (``<file>:<line>``)."""
    check_dataset(cfg.training.dataset or "", cfg.training.dataset_path or None, preview=True)
    if cfg.model.hf_assets_path not in (None, "", "embedded"):
        check_tokenizer_folder(cfg.model.hf_assets_path)
