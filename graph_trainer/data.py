"""Offline data for graph_trainer: an embedded text corpus, a BPE tokenizer
trained on it, and torchtitan dataset registration.

Everything is built on first use and cached under :func:`cache_dir`
(``$GRAPH_TRAINER_CACHE``, default ``~/.cache/graph_trainer``)::

    <cache>/corpus_v1/part-0000.jsonl ...   {"text": ...} per line
    <cache>/tokenizer_<vocab>/tokenizer.json, tokenizer_config.json

The corpus is real English that ships with Python: the help topics of
``pydoc_data.topics`` plus the longer docstrings of the top-level stdlib
modules. Builds are atomic (a temporary folder renamed into place) and
serialized with ``fcntl.flock``, so torchrun ranks racing on a cold cache all
end up with the same files.
"""

from __future__ import annotations

import ast
import difflib
import fcntl
import gzip
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

from graph_trainer.errors import UserError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EMBEDDED = "embedded"

_CORPUS_NAME = "corpus_v1"  # bump when the corpus recipe changes
_CORPUS_SHARDS = 4
_DOC_CHARS = 2000  # documents are paragraphs merged up to about this size
#: The names ``--training.dataset`` accepts (case-insensitive): what
#: :func:`register_datasets` leaves in torchtitan's ``DATASETS`` table.
DATASET_NAMES = ("c4", "c4_test", "c4_validation", "local")
#: Files torchtitan's ``HuggingFaceTokenizer`` loads a tokenizer from (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
_PREFLIGHT_RECORDS = 5  # records whose values preflight() checks per data file
_PREFLIGHT_FILES = 8  # data files of a folder read by preflight()


# --------------------------------------------------------------------------- #
# cache helpers
# --------------------------------------------------------------------------- #


def cache_dir() -> Path:
    """Return the graph_trainer cache folder (not created).

    Returns:
        ``$GRAPH_TRAINER_CACHE`` if set, else ``~/.cache/graph_trainer``.
    """
    env = os.environ.get("GRAPH_TRAINER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "graph_trainer"


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Create folder ``final`` by calling ``build(tmp_folder)`` exactly once.

    An exclusive flock on ``<final>.lock`` serializes concurrent builders; the
    result is written into a temporary sibling and renamed into place, so a
    reader never sees a half-written folder.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if final.is_dir():  # another process finished while we waited
                return final
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            try:
                build(tmp)
                os.rename(tmp, final)
            except OSError:
                # Lost a race on a filesystem without working flock: keep theirs.
                if not final.is_dir():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


# --------------------------------------------------------------------------- #
# embedded corpus
# --------------------------------------------------------------------------- #


def _chunk(text: str, size: int = _DOC_CHARS) -> list[str]:
    """Split ``text`` at blank lines into pieces of about ``size`` characters."""
    chunks, cur = [], ""
    for para in text.split("\n\n"):
        para = para.strip("\n")
        if not para.strip():
            continue
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= size:
            chunks.append(cur)
            cur = ""
    if cur:
        chunks.append(cur)
    return chunks


def _stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """One text per top-level stdlib module: its docstrings of >= min_chars."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for file in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, defs)]
        docs = [d for n in nodes if (d := ast.get_docstring(n)) and len(d) >= min_chars]
        if docs:
            texts.append("\n\n".join(docs))
    return texts


def corpus_documents() -> list[str]:
    """Return the documents of the embedded corpus, in a fixed order.

    Returns:
        A list of English text documents (about 2 KB each, several hundred):
        the ``pydoc_data`` help topics followed by stdlib module docstrings.
    """
    from pydoc_data.topics import topics

    sources = [topics[k] for k in sorted(topics)] + _stdlib_docstrings()
    return [doc for text in sources for doc in _chunk(text)]


def corpus_dir() -> Path:
    """Return where the embedded corpus lives (it may not exist yet).

    Returns:
        ``<cache>/corpus_v1``.
    """
    return cache_dir() / _CORPUS_NAME


def ensure_corpus() -> Path:
    """Build the embedded corpus if needed and return its folder.

    Returns:
        The folder of ``part-*.jsonl`` files, one ``{"text": ...}`` record per line.
    """

    def build(tmp: Path) -> None:
        docs = corpus_documents()
        per_shard = -(-len(docs) // _CORPUS_SHARDS)
        for i in range(_CORPUS_SHARDS):
            with open(tmp / f"part-{i:04d}.jsonl", "w", encoding="utf-8") as f:
                for doc in docs[i * per_shard : (i + 1) * per_shard]:
                    f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")

    return _build_once(corpus_dir(), build)


# --------------------------------------------------------------------------- #
# tokenizer
# --------------------------------------------------------------------------- #


def ensure_tokenizer(vocab_size: int) -> Path:
    """Train (once) a byte-level BPE tokenizer on the embedded corpus.

    Training is deterministic, so every process and rerun gets byte-identical
    files. If the corpus cannot support ``vocab_size`` merges, the vocabulary is
    padded with ``<|reserved_special_token_N|>`` tokens so that its size is exact.

    Args:
        vocab_size: Total vocabulary size, including the two special tokens.

    Returns:
        Folder ``<cache>/tokenizer_<vocab_size>`` with ``tokenizer.json`` and
        ``tokenizer_config.json``, loadable by torchtitan's ``HuggingFaceTokenizer``.

    Raises:
        UserError: if ``vocab_size`` is smaller than 258 (256 bytes + BOS + EOS).
    """
    if vocab_size < 258:
        raise UserError(
            f"The embedded tokenizer needs a vocab size of at least 258 (256 bytes "
            f"plus BOS and EOS), got {vocab_size}. Set the model's vocab_size to 258 "
            f"or more, or point --model.hf_assets_path at your own tokenizer folder."
        )

    def build(tmp: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS_TOKEN, EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus_documents(), trainer=trainer)
        missing = vocab_size - tok.get_vocab_size()
        if missing > 0:
            tok.add_special_tokens(
                [f"<|reserved_special_token_{i}|>" for i in range(missing)]
            )
        tok.save(str(tmp / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": True,
            "add_eos_token": True,
            "clean_up_tokenization_spaces": False,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    return _build_once(cache_dir() / f"tokenizer_{vocab_size}", build)


def is_embedded_tokenizer(hf_assets_path: str | None) -> bool:
    """Whether ``--model.hf_assets_path`` asks for the built-in tokenizer.

    Returns:
        True for None, "" and "embedded".
    """
    return not hf_assets_path or hf_assets_path == EMBEDDED


def check_tokenizer_folder(hf_assets_path: str) -> Path:
    """Check that ``--model.hf_assets_path`` is a folder torchtitan can load a tokenizer from.

    Cheap: looks at file names and parses ``tokenizer_config.json`` if there is one; the
    tokenizer itself is not loaded.

    Args:
        hf_assets_path: The folder (not one of the embedded spellings).

    Returns:
        The folder, with ``~`` expanded.

    Raises:
        UserError: the folder does not exist, is a file, holds none of
            :data:`TOKENIZER_FILES`, or its ``tokenizer_config.json`` is not valid JSON.
    """
    flag = f"--model.hf_assets_path {hf_assets_path}"
    embedded_hint = "or set --model.hf_assets_path embedded for the built-in offline tokenizer."
    path = Path(hf_assets_path).expanduser()
    if not path.exists():
        raise UserError(
            f"{flag}: this tokenizer folder does not exist. Download the model's tokenizer there "
            f"(torchtitan's scripts/download_hf_assets.py --assets tokenizer), {embedded_hint}"
        )
    if not path.is_dir():
        raise UserError(f"{flag}: is a file, not a tokenizer folder. Point it at the folder holding "
                        f"tokenizer.json, {embedded_hint}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        found = sorted(p.name for p in path.iterdir())
        listed = ", ".join(found[:10]) + (", ..." if len(found) > 10 else "") if found else "nothing"
        sentencepiece = (" (tokenizer.model alone, a SentencePiece model, is not loadable by "
                         "torchtitan's HuggingFaceTokenizer)" if "tokenizer.model" in found else "")
        raise UserError(
            f"{flag}: contains none of {', '.join(TOKENIZER_FILES)} (found: {listed}){sentencepiece}.\n"
            f"Put your model's tokenizer files in this folder, {embedded_hint}"
        )
    config = path / "tokenizer_config.json"
    if config.is_file():
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise UserError(f"{_json_error(config, e)} ({flag}). Fix the file, or delete it to let torchtitan "
                            f"infer the special tokens.") from None
    return path


def resolve_tokenizer_path(hf_assets_path: str | None, vocab_size: int) -> str:
    """Return the tokenizer folder to load for ``--model.hf_assets_path``.

    Args:
        hf_assets_path: A folder with tokenizer files, or None / "" / "embedded"
            for the built-in tokenizer trained on the embedded corpus.
        vocab_size: Vocabulary size of the embedded tokenizer (ignored otherwise).

    Returns:
        Path of a folder that ``HuggingFaceTokenizer`` can load.

    Raises:
        UserError: if the folder does not exist or holds no tokenizer file
            (:func:`check_tokenizer_folder`).
    """
    if is_embedded_tokenizer(hf_assets_path):
        return str(ensure_tokenizer(vocab_size))
    return str(check_tokenizer_folder(hf_assets_path))


# --------------------------------------------------------------------------- #
# datasets
# --------------------------------------------------------------------------- #

_FIX = "fix or delete it (--training.dataset_path wants JSON objects with a 'text' string, one per line)"


def _builder_for(file: Path) -> str | None:
    """The ``datasets`` builder for a data file (.json/.jsonl, gzipped or not, .parquet), or None."""
    name = file.name.lower()
    if name.removesuffix(".gz").endswith((".json", ".jsonl")):
        return "json"
    return "parquet" if name.endswith(".parquet") else None


def _data_files(path: str) -> tuple[str, list[str]]:
    """Return (builder, sorted data files) for a file or a folder of files.

    Own check: given a folder, ``datasets`` picks files by its own patterns, so it would not
    refuse a folder without data files, files of unknown type or a JSON/Parquet mix with a
    message naming the flag (``test_bad_data_named``).

    Raises:
        UserError: ``<path>: does not exist`` / ``is not a .json, ...`` / ``contains no ...``
            / ``mixes JSON and Parquet files``.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{path}: does not exist (--training.dataset_path). Point it at a .json/.jsonl/.parquet "
                        f"file or a folder of them with a 'text' column, or drop --training.dataset_path to use "
                        f"the built-in corpus (--training.dataset c4_test).")
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    builders = {f: b for f in files if (b := _builder_for(f))}
    kinds = set(builders.values())
    if len(kinds) != 1:
        problem = ("is not a .json, .jsonl(.gz) or .parquet file" if p.is_file() else
                   "mixes JSON and Parquet files" if kinds else "contains no .json, .jsonl(.gz) or .parquet files")
        raise UserError(f"{path}: {problem} (--training.dataset_path). Point it at one such file, or a folder "
                        f"whose top-level data files are all JSON or all Parquet, with a 'text' column.")
    return kinds.pop(), [str(f) for f in builders]


def _json_error(file: Path | str, e: ValueError, lineno: int | None = None) -> str:
    """``"<file>:<line>: not valid JSON (<reason>)"`` for a ``JSONDecodeError`` or
    ``UnicodeDecodeError``; the line is ``lineno``, else the decoder's, else left out."""
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
    """Find the first record of a JSON / JSON Lines file (gzipped or not) that is not a document.

    Own code because the ``datasets`` JSON loader's errors carry no usable line: its scan of
    a file's first chunk reports a position within a line only, and pyarrow's "row N" counts
    from the start of a read block and skips empty lines; a null or non-string ``text`` loads
    without error (``test_bad_data_named``). Only called after the loader failed, or left the
    ``text`` column unusable.

    Returns:
        ``"<file>:<line>: <problem>"`` for a line that is empty, not valid JSON (or not
        UTF-8), or has no ``text`` string; ``"<file>: record <n> of the JSON array: ..."``
        in a file holding one JSON array; ``"<file>: holds no records"``; None if all is fine.

    Raises:
        OSError, EOFError: the file (or its gzip stream) cannot be read.
    """
    with (gzip.open if file.lower().endswith(".gz") else open)(file, "rb") as f:
        lineno = 0
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.lstrip().startswith(b"["):
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
    """The ``UserError`` for a load that raised ``error``, or (None) left ``text`` unusable.

    Names the first bad record of the JSON files (:func:`_first_bad_record`); failing that,
    ``label`` and the loader's own error.
    """
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


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Mute ``datasets``' loggers: its builders log a failure before raising it, and we report it."""
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _load_checked(builder: str, files: list[str], label: str, hf_cache: str | None = None,
                  preview: int | None = None):
    """``datasets.load_dataset(builder, data_files=files)``, checked for a ``text`` string column.

    Args:
        builder: ``"json"`` or ``"parquet"``.
        files: The data files, loaded in this order.
        label: What the user named (file or folder), for messages that name no single file.
        hf_cache: ``datasets`` Arrow cache folder (default: the HF cache).
        preview: Stream the files and check only the first ``preview`` records' values (the
            JSON loader still parses the first chunk of a file, about 10 MB, and infers its
            column types from it); None: load and check the files whole.

    Returns:
        The ``datasets.Dataset`` (``train`` split); an ``IterableDataset`` with ``preview``.

    Raises:
        UserError: see :func:`_bad_data`; ``<label>: no 'text' column`` if no record has one.
    """
    from datasets import load_dataset

    try:
        with _quiet_datasets():
            ds = load_dataset(builder, data_files=files, split="train", cache_dir=hf_cache,
                              streaming=preview is not None)
            rows = list(islice(ds, preview)) if preview else []
    except Exception as e:  # noqa: BLE001 - pyarrow / pandas / ujson / datasets errors of every type
        raise _bad_data(builder, files, label, e) from None
    features = ds.features  # None when streaming a JSON array file
    names = list(features or (rows[0] if rows else {}))
    if "text" not in names:
        raise UserError(f"{label}: no 'text' column (columns: {', '.join(names) or 'none'}) "
                        f"(--training.dataset_path). Store one document per record under the key 'text'.")
    kind = getattr(features["text"], "dtype", None) if features else "string"
    if kind not in ("string", "large_string") or (
        any(not isinstance(r.get("text"), str) for r in rows) if preview else ds.data.column("text").null_count
    ):
        raise _bad_data(builder, files, label, None)
    return ds


def load_local_text(path: str | None, hf_cache: str | None = None):
    """Load a local JSON / JSONL / Parquet file or folder as a ``datasets.Dataset``.

    Args:
        path: A data file, or a folder whose top-level data files are loaded
            (sorted by name). Records need a ``text`` string.
        hf_cache: ``datasets`` Arrow cache folder (default: the HF cache).

    Returns:
        A map-style ``datasets.Dataset`` (the ``train`` split).

    Raises:
        UserError: if the path is None or missing, holds no supported files, or has no
            ``text`` column; ``<file>:<line>: ...`` for the first record that is not valid
            JSON or has no ``text`` string; else the loader's error, with the path.
    """
    if path is None:
        raise UserError(
            "Dataset 'local' needs a file or folder: set --training.dataset_path to "
            "a .json/.jsonl/.parquet file or a folder of them with a 'text' column."
        )
    builder, files = _data_files(path)
    return _load_checked(builder, files, path, hf_cache)


def _load_embedded_or_local(path: str | None):
    """``c4_test`` loader: the embedded corpus (built on demand) or a local path."""
    if path is None or Path(path).expanduser() == corpus_dir():
        hf_cache = str(cache_dir() / "hf_datasets")
        return load_local_text(str(ensure_corpus()), hf_cache=hf_cache)
    return load_local_text(path)


def _local_or(hub_loader: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a hub loader so that a local data file / folder is loaded locally."""

    def loader(path: str):
        p = Path(path).expanduser()
        if p.is_file() or (p.is_dir() and any(_builder_for(f) for f in p.iterdir())):
            return load_local_text(path)
        return hub_loader(path)

    loader._graph_trainer_local = True
    return loader


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Register graph_trainer's datasets in torchtitan's ``DATASETS`` table.

    * ``c4_test``: the embedded offline corpus (built on first load).
    * ``c4`` / ``c4_validation``: torchtitan's streaming ``allenai/c4``.
    * ``local``: the file or folder given by ``--training.dataset_path``.

    With ``--training.dataset_path`` pointing at a local JSON/JSONL/Parquet file
    or folder, every name loads it locally. Safe to call repeatedly (re-reads
    ``$GRAPH_TRAINER_CACHE``).
    """
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name in ("c4", "c4_validation"):
        cfg = DATASETS[name]
        if not getattr(cfg.loader, "_graph_trainer_local", False):
            DATASETS[name] = DatasetConfig(
                path=cfg.path,
                loader=_local_or(cfg.loader),
                sample_processor=cfg.sample_processor,
            )
    DATASETS["c4_test"] = DatasetConfig(
        path=str(corpus_dir()), loader=_load_embedded_or_local, sample_processor=_text
    )
    DATASETS["local"] = DatasetConfig(
        path=None, loader=load_local_text, sample_processor=_text
    )


def check_dataset(name: str, path: str | None, preview: bool = False) -> None:
    """Validate ``--training.dataset`` / ``--training.dataset_path`` early, before any model is built.

    Args:
        name: Dataset name (case-insensitive), one of :data:`DATASET_NAMES`.
        path: Optional ``--training.dataset_path``.
        preview: Also stream the first files of a local path through ``datasets``
            (:func:`_load_checked`): the first chunk of each (about 10 MB of JSON, or a
            Parquet row group) must parse and hold a ``text`` string column, and its first
            records a ``text`` string. Values further on (a null ``text`` deep in a file, or
            anything in a JSON array file, which is streamed JSON-encoded) are checked when
            :func:`load_local_text` loads the data.

    Raises:
        UserError: an unknown name (with the closest valid one), ``local`` without a path, a
            missing or unusable path; with ``preview``, ``<file>:<line>: ...`` for a bad record.
    """
    key = name.lower()
    if key not in DATASET_NAMES:
        close = difflib.get_close_matches(key, DATASET_NAMES, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise UserError(
            f"Unknown dataset '{name}' (--training.dataset). Valid names: {', '.join(DATASET_NAMES)}.{hint}\n"
            f"Use c4_test for the built-in offline corpus, or local with --training.dataset_path for your own files."
        )
    if not path:
        if key == "local":
            load_local_text(None)  # raises the UserError explaining the fix
        return
    p = Path(path).expanduser()
    if (key == "c4_test" and p == corpus_dir()) or (
        key in ("c4", "c4_validation") and p.is_dir() and not any(_builder_for(f) for f in p.iterdir())
    ):
        return  # the embedded corpus (built on first use), or a local clone of the hub dataset
    builder, files = _data_files(path)
    for i, file in enumerate(files[:_PREFLIGHT_FILES] if preview else []):
        if i == 0 or os.path.getsize(file):  # datasets loads an empty file after the first
            _load_checked(builder, [file], file, preview=_PREFLIGHT_RECORDS)


def preflight(cfg) -> None:
    """Check what the config says about data and tokenizer, fast, before anything starts.

    Trains nothing and imports no torchtitan, so it can run in the launcher's config
    check. Checks ``--training.dataset`` and ``--training.dataset_path`` with the first
    records of the data (:func:`check_dataset` with ``preview``), and that
    ``--model.hf_assets_path`` is ``embedded`` (or empty) or a folder holding a tokenizer
    torchtitan can load (:func:`check_tokenizer_folder`). Not checked: hub datasets (``c4``
    without a local path) and the vocabulary size the embedded tokenizer is built for.

    Args:
        cfg: The parsed JobConfig (``training.dataset``, ``training.dataset_path``,
            ``model.hf_assets_path`` are read).

    Raises:
        UserError: one or two lines naming the flag and the file (``<file>:<line>`` for
            a bad record).
    """
    check_dataset(cfg.training.dataset or "", cfg.training.dataset_path or None, preview=True)
    if not is_embedded_tokenizer(cfg.model.hf_assets_path):
        check_tokenizer_folder(cfg.model.hf_assets_path)
