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
import fcntl
import gzip
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from graph_trainer.errors import UserError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EMBEDDED = "embedded"

_CORPUS_NAME = "corpus_v1"  # bump when the corpus recipe changes
_CORPUS_SHARDS = 4
_DOC_CHARS = 2000  # documents are paragraphs merged up to about this size
_TEXT_SUFFIXES = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
}
#: The names ``--training.dataset`` accepts (case-insensitive): what
#: :func:`register_datasets` leaves in torchtitan's ``DATASETS`` table.
DATASET_NAMES = ("c4", "c4_test", "c4_validation", "local")
#: Files torchtitan's ``HuggingFaceTokenizer`` loads a tokenizer from (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
_PREFLIGHT_RECORDS = 5  # records read per data file by preflight()
_PREFLIGHT_FILES = 8  # data files of a folder read by preflight()
_PREFLIGHT_DOCUMENT_BYTES = 16 << 20  # larger one-document JSON files are left to load time


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
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _json_error(config, e, f" ({flag}). Fix the file, or delete it to let torchtitan infer "
                                         f"the special tokens.") from None
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


def _builder_for(file: Path) -> str | None:
    """The ``datasets`` builder name for a data file, or None if unsupported."""
    name = file.name.lower()
    for suffix, builder in _TEXT_SUFFIXES.items():
        if name.endswith(suffix):
            return builder
    return None


def _data_files(path: str) -> tuple[str, list[str]]:
    """Return (builder, sorted data files) for a file or a folder of files."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"Dataset path '{path}' (--training.dataset_path) does not exist. Point it "
            f"at a .json/.jsonl/.parquet file or a folder of them with a 'text' "
            f"column, or drop --training.dataset_path to use the built-in corpus "
            f"(--training.dataset c4_test)."
        )
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    builders = {f: b for f in files if (b := _builder_for(f))}
    kinds = set(builders.values())
    if len(kinds) != 1:
        if p.is_file():
            problem = "is not a .json, .jsonl(.gz) or .parquet file"
        elif kinds:
            problem = "mixes JSON and Parquet files"
        else:
            problem = "contains no .json, .jsonl(.gz) or .parquet files"
        raise UserError(
            f"Dataset path '{path}' (--training.dataset_path) {problem}. Point it at "
            f"one such file, or a folder whose top-level data files are all JSON or "
            f"all Parquet, with a 'text' column."
        )
    return kinds.pop(), [str(f) for f in builders]


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "true/false", type(None): "null"}
_JSONL_FIX = ("fix or delete that line (--training.dataset_path wants one JSON object with a "
              "'text' string per line)")


def _json_error(path, e: Exception, advice: str) -> UserError:
    """``UserError("<path>[:<line>]: not valid JSON (<reason>)<advice>")`` for a decoding error
    of a whole JSON file (the line only for ``JSONDecodeError``)."""
    line = f":{e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
    return UserError(f"{path}{line}: not valid JSON ({_reason(e)}){advice}")


def _reason(e: Exception) -> str:
    """A short reason for a JSON decoding error, without the position already reported."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg.removesuffix(' at')}, column {e.colno}"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8: byte 0x{e.object[e.start]:02x} at column {e.start + 1}"
    return str(e)


def _record_problem(record: Any, strings_ok: bool = False) -> str | None:
    """What is wrong with one decoded record, or None if it carries a ``text`` string."""
    if strings_ok and isinstance(record, str):
        return None  # a JSON array of strings: datasets reads them as the text column
    if not isinstance(record, dict):
        return f"{_JSON_KINDS.get(type(record), 'a value')}, not an object with a 'text' field"
    if "text" not in record:
        keys = ", ".join(repr(k) for k in list(record)[:6]) or "none"
        return f"no 'text' field (keys: {keys})"
    if not isinstance(record["text"], str):
        return f"'text' is {_JSON_KINDS.get(type(record['text']), 'a value')}, not a string"
    return None


def _open_data(file: str):
    """Open a (possibly gzipped) data file for reading bytes."""
    return gzip.open(file, "rb") if file.lower().endswith(".gz") else open(file, "rb")


def _too_big_to_parse(file: str, max_records: int | None) -> bool:
    """Whether a limited check (``max_records``) skips parsing ``file`` as one document."""
    if max_records is None:
        return False
    limit = _PREFLIGHT_DOCUMENT_BYTES // (8 if file.lower().endswith(".gz") else 1)
    return os.path.getsize(file) > limit


def _check_json_array(file: str, max_records: int | None) -> int:
    """:func:`check_json_file` for a file holding one JSON array of records."""
    if _too_big_to_parse(file, max_records):
        return 0  # load_local_text checks it when it loads
    try:
        with _open_data(file) as f:
            records = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _json_error(file, e, "; fix the file (--training.dataset_path wants a JSON array of objects "
                                   "with a 'text' string, or one such object per line).") from None
    except (OSError, EOFError) as e:
        raise UserError(f"{file}: cannot be read ({e}) (--training.dataset_path).") from None
    if not isinstance(records, list):
        return 0
    for i, record in enumerate(records[:max_records] if max_records else records):
        if problem := _record_problem(record, strings_ok=True):
            raise UserError(
                f"{file}: record {i + 1} of the JSON array: {problem}; fix that record "
                f"(--training.dataset_path wants a 'text' string in every record)."
            )
    return len(records)


def check_json_file(file: str, max_records: int | None = None, allow_empty: bool = True) -> int:
    """Check that a JSON / JSON Lines data file (optionally gzipped) holds text records.

    A JSON Lines file is read line by line: every non-empty line must be a JSON object
    with a ``text`` string. A file whose first character is ``[`` is parsed as one JSON
    array of such objects (or of strings). Empty lines are skipped while reading; in a
    full check (``max_records=None``) the first one is reported if nothing else is wrong,
    since the ``datasets`` JSON loader can refuse them.

    Args:
        file: Path of a ``.json``, ``.jsonl``, ``.json.gz`` or ``.jsonl.gz`` file.
        max_records: Stop after this many records (None: read the whole file). With a
            limit, a JSON array file larger than 16 MiB (2 MiB gzipped) is not parsed.
        allow_empty: Accept a file without any record (the ``datasets`` loader cannot
            read a folder whose first file is empty).

    Returns:
        The number of records checked.

    Raises:
        UserError: ``<file>:<line>: not valid JSON (...)`` for a line that does not
            parse (or is not UTF-8), ``<file>:<line>: ...`` for a record without a
            ``text`` string, an empty line (full check only), an unreadable file, or
            (``allow_empty=False``) a file without records.
    """
    checked, first_blank = 0, None
    try:
        with _open_data(file) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    first_blank = first_blank or lineno
                    continue
                if checked == 0 and raw.lstrip().startswith(b"["):
                    return _check_json_array(file, max_records)
                try:
                    record = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    if checked == 0 and _is_one_json_document(file, max_records):
                        return 0  # one (pretty-printed) JSON object: left to the datasets loader
                    raise UserError(f"{file}:{lineno}: not valid JSON ({_reason(e)}); {_JSONL_FIX}.") from None
                if problem := _record_problem(record):
                    raise UserError(f"{file}:{lineno}: {problem}; {_JSONL_FIX}.")
                checked += 1
                if max_records is not None and checked >= max_records:
                    return checked
    except (OSError, EOFError) as e:
        raise UserError(f"{file}: cannot be read ({e}) (--training.dataset_path).") from None
    if checked == 0 and not allow_empty:
        raise UserError(f"{file}: holds no records (--training.dataset_path). Fill it with one JSON object "
                        f"with a 'text' string per line, or remove it.")
    if max_records is None and first_blank is not None:
        raise UserError(f"{file}:{first_blank}: empty line; delete it (--training.dataset_path wants one "
                        f"JSON object with a 'text' string per line, no empty lines).")
    return checked


def _is_one_json_document(file: str, max_records: int | None) -> bool:
    """Whether a ``.json`` file is one multi-line JSON object (not JSON Lines)."""
    name = file.lower()
    if not (name.endswith(".json") or name.endswith(".json.gz")):
        return False
    if _too_big_to_parse(file, max_records):
        return False
    try:
        with _open_data(file) as f:
            return isinstance(json.loads(f.read().decode("utf-8")), dict)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def check_parquet_file(file: str) -> None:
    """Check that a Parquet file is readable and has a string ``text`` column (schema only).

    Args:
        file: Path of a ``.parquet`` file.

    Raises:
        UserError: the footer cannot be read, or there is no ``text`` string column.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(file)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{file}: not a readable Parquet file ({e}) (--training.dataset_path).") from None
    if "text" not in schema.names:
        raise UserError(f"{file}: no 'text' column (columns: {', '.join(schema.names[:10])}) "
                        f"(--training.dataset_path). Store one document per row under 'text'.")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f"{file}: column 'text' holds {kind}, not strings (--training.dataset_path).")


def _check_data_files(builder: str, files: list[str], max_records: int | None, max_files: int | None) -> None:
    """Run :func:`check_json_file` / :func:`check_parquet_file` over ``files``.

    Raises:
        UserError: the first problem found, or a first JSON file without records.
    """
    for i, file in enumerate(files[:max_files] if max_files else files):
        if builder == "parquet":
            check_parquet_file(file)
        else:
            check_json_file(file, max_records, allow_empty=i > 0)


@contextmanager
def _quiet_datasets_json() -> Iterator[None]:
    """Mute the ``datasets`` JSON loader's own error log (its failures are reported by us)."""
    log = logging.getLogger("datasets.packaged_modules.json.json")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _load_files(path: str, builder: str, files: list[str], hf_cache: str | None):
    """``datasets.load_dataset`` over local files; a failure names the file and line.

    The files are only read by our own checks when ``datasets`` fails or leaves the
    ``text`` column unusable, so good files load exactly as ``datasets`` loads them.

    Raises:
        UserError: ``<file>:<line>: ...`` for the first bad record, or the loader's error
            with the path if no bad record is found.
    """
    from datasets import load_dataset

    try:
        with _quiet_datasets_json():
            ds = load_dataset(builder, data_files=files, split="train", cache_dir=hf_cache)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow / pandas / datasets errors of every type
        _check_data_files(builder, files, max_records=None, max_files=None)
        cause = e.__cause__ or e.__context__ or e
        raise UserError(
            f"Dataset path '{path}' (--training.dataset_path) could not be loaded: "
            f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        ) from None
    if "text" in ds.column_names:
        feature = ds.features["text"]
        bad_kind = getattr(feature, "dtype", None) not in ("string", "large_string")
        if bad_kind or ds.data.column("text").null_count:
            _check_data_files(builder, files, max_records=None, max_files=None)
            what = f"holds {feature}" if bad_kind else "is missing in some records"
            raise UserError(f"Dataset path '{path}' (--training.dataset_path): column 'text' {what}; "
                            f"every record needs a 'text' string.")
    return ds


def load_local_text(path: str | None, hf_cache: str | None = None):
    """Load a local JSON / JSONL / Parquet file or folder as a ``datasets.Dataset``.

    Args:
        path: A data file, or a folder whose top-level data files are loaded
            (sorted by name). Records need a ``text`` field.
        hf_cache: ``datasets`` Arrow cache folder (default: the HF cache).

    Returns:
        A map-style ``datasets.Dataset`` (the ``train`` split).

    Raises:
        UserError: if the path is None or missing, holds no supported files, or
            its records have no ``text`` column; ``<file>:<line>: ...`` for a record
            that is not valid JSON or has no ``text`` string (:func:`check_json_file`).
    """
    if path is None:
        raise UserError(
            "Dataset 'local' needs a file or folder: set --training.dataset_path to "
            "a .json/.jsonl/.parquet file or a folder of them with a 'text' column."
        )
    builder, files = _data_files(path)
    ds = _load_files(path, builder, files, hf_cache)
    if "text" not in ds.column_names:
        raise UserError(
            f"Dataset path '{path}' has no 'text' column (columns: {ds.column_names}). "
            f"Store one document per record under the key 'text'."
        )
    return ds


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


def check_dataset(name: str, path: str | None) -> None:
    """Validate ``--training.dataset`` / ``--training.dataset_path`` early.

    Call before building the model so that typos fail in seconds.

    Args:
        name: Dataset name (case-insensitive), e.g. ``c4_test``, ``c4``, ``local``.
        path: Optional ``--training.dataset_path``.

    Raises:
        UserError: on an unknown name, a missing or unusable path, or ``local``
            without a path.
    """
    from torchtitan.hf_datasets.text_datasets import DATASETS

    register_datasets()
    key = name.lower()
    if key not in DATASETS:
        raise UserError(
            f"Unknown dataset '{name}' (--training.dataset). Valid names: "
            f"{', '.join(sorted(DATASETS))}. Use c4_test for the built-in offline "
            f"corpus, or local with --training.dataset_path for your own files."
        )
    if not path:
        if key == "local":
            load_local_text(None)  # raises the UserError explaining the fix
        return
    p = Path(path).expanduser()
    if key in ("c4", "c4_validation") and p.is_dir():
        return  # may also be a local clone of the hub dataset
    _data_files(path)  # raises UserError if missing or unusable


def preflight(cfg) -> None:
    """Check what the config says about data and tokenizer, fast, before anything starts.

    Imports neither torch nor torchtitan and trains nothing, so it can run in the
    launcher's config check. It checks:

    * ``--training.dataset`` is one of :data:`DATASET_NAMES`;
    * ``--training.dataset_path``: given for ``local``; exists; is a supported file, or a
      folder of supported files of one kind (as :func:`load_local_text` loads them);
      the first records of its first files are valid JSON objects with a ``text``
      string (:func:`check_json_file`), or, for Parquet, the schema has a ``text``
      string column (:func:`check_parquet_file`);
    * ``--model.hf_assets_path`` is ``embedded`` (or empty), or a folder holding a
      tokenizer torchtitan can load (:func:`check_tokenizer_folder`).

    Not checked here: records past the first few (a bad line deep in a file is named
    when the dataset is loaded, by :func:`load_local_text`), hub datasets (``c4``
    without a local path), and the vocabulary size the embedded tokenizer is built for.

    Args:
        cfg: The parsed JobConfig (``training.dataset``, ``training.dataset_path``,
            ``model.hf_assets_path`` are read).

    Raises:
        UserError: one or two lines naming the flag and the file (``<file>:<line>`` for
            a bad record).
    """
    name = cfg.training.dataset or ""
    path = cfg.training.dataset_path or None
    key = name.lower()
    if key not in DATASET_NAMES:
        import difflib

        close = difflib.get_close_matches(key, DATASET_NAMES, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise UserError(
            f"Unknown dataset '{name}' (--training.dataset). Valid names: {', '.join(DATASET_NAMES)}.{hint}\n"
            f"Use c4_test for the built-in offline corpus, or local with --training.dataset_path for your own files."
        )
    if path is None:
        if key == "local":
            raise UserError(
                "--training.dataset local needs --training.dataset_path: a .json/.jsonl/.parquet file "
                "or a folder of them with a 'text' column."
            )
    else:
        p = Path(path).expanduser()
        local = not (
            (key == "c4_test" and p == corpus_dir())  # the embedded corpus, built on first use
            or (key in ("c4", "c4_validation") and p.is_dir() and not any(_builder_for(f) for f in p.iterdir()))
        )  # the second: a local clone of the hub dataset, loaded by datasets itself
        if local:
            builder, files = _data_files(path)
            _check_data_files(builder, files, max_records=_PREFLIGHT_RECORDS, max_files=_PREFLIGHT_FILES)
    hf_assets_path = cfg.model.hf_assets_path
    if not is_embedded_tokenizer(hf_assets_path):
        check_tokenizer_folder(hf_assets_path)
