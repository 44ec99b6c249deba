"""Loading task data as ``datasets.DatasetDict`` and turning it into batches.

Every task, whatever its source, comes out in one layout so the trainer never
special-cases a task:

* splits ``train`` and ``dev``; MNLI adds ``dev_mismatched``; the RT tasks add
  ``test`` (GLUE's test labels are hidden, so GLUE tasks have none);
* columns ``text_a`` (str), ``text_b`` (str, **only** for sentence-pair tasks;
  single-sentence tasks have no ``text_b`` column at all) and ``label``
  (a ``ClassLabel`` id for classification, a float for stsb).

Sources: ``hub`` (the Hugging Face ``glue`` dataset; needs internet), ``local``
(GLUE's original TSV files under ``<data_dir>/<glue_dir>/``), ``rt`` (the
offline Rotten Tomatoes corpus, split once with a fixed seed). ``auto`` picks
``rt`` for RT tasks, ``local`` when ``data_dir`` is given, else ``hub``.

:func:`tokenize` encodes without padding and :func:`make_loader` pads each
batch to its own longest sequence (dynamic padding), which is much cheaper than
padding every example to ``max_length``.
"""
from __future__ import annotations

import csv
import re
import warnings
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import torch
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase

from .assets import rt_corpus_path
from .errors import AclLabError, bad_value
from .hub import hub_unreachable_reason
from .tasks import DEFAULT_TASK, TaskSpec, get_task

SPLIT_SEED = 1234
"""Seed of the fixed RT train/dev/test split and of ``max_eval_samples`` subsampling.

It is independent of the training seed so that every run, whatever its seed,
trains and is scored on the same examples.
"""

SOURCES = ("auto", "hub", "local", "rt")
HUB_DATASET = "nyu-mll/glue"
_MAX_LINES_SHOWN = 5


def _features(spec: TaskSpec) -> datasets.Features:
    """The column schema shared by every source for ``spec``."""
    cols = {"text_a": datasets.Value("string")}
    if spec.is_pair:
        cols["text_b"] = datasets.Value("string")
    cols["label"] = (datasets.Value("float32") if spec.is_regression
                     else datasets.ClassLabel(names=list(spec.label_names)))
    return datasets.Features(cols)


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise bad_value(name, value, "a positive integer or None (no limit)",
                        f"pass e.g. {name}=1000, or leave it unset to use the whole split.")


def _subsample(split: datasets.Dataset, n: int | None, seed: int) -> datasets.Dataset:
    """A seeded random subset of ``n`` rows (kept in their original order); all rows if ``n`` is None or larger."""
    if n is None or n >= len(split):
        return split
    idx = np.sort(np.random.default_rng(seed).choice(len(split), size=n, replace=False))
    return split.select(idx.tolist())


def load_task(task: str, source: str = "auto", data_dir: str | None = None,
              max_train_samples: int | None = None, seed: int = 0,
              max_eval_samples: int | None = None) -> datasets.DatasetDict:
    """Load ``task`` as a ``DatasetDict`` in the layout described in the module docstring.

    ``max_train_samples`` keeps a random subset of train chosen with ``seed``;
    ``max_eval_samples`` keeps a random subset of each evaluation split chosen
    with :data:`SPLIT_SEED` (so runs with different seeds see the same eval set).
    Both are meant for quick smoke runs.
    """
    spec = get_task(task)
    if source not in SOURCES:
        raise bad_value("Data source", source, SOURCES,
                        "use 'auto' (the default) unless you need to force one source.")
    _check_limit("max_train_samples", max_train_samples)
    _check_limit("max_eval_samples", max_eval_samples)
    if source == "auto":
        source = "rt" if spec.source == "rt" else ("local" if data_dir else "hub")
    if spec.source == "rt" and source != "rt":
        raise AclLabError(
            f"Task {spec.name!r} comes from the offline Rotten Tomatoes corpus, so source {source!r} "
            "is not valid; allowed: 'auto', 'rt'. Fix: drop --source/--data-dir for RT tasks."
        )
    if spec.source == "glue" and source == "rt":
        raise AclLabError(
            f"Source 'rt' is only for the RT tasks, not GLUE task {spec.name!r}; allowed: 'auto', 'hub', 'local'. "
            f"Fix: use --task {DEFAULT_TASK} for the offline corpus, or drop --source."
        )
    if source == "rt":
        dd = _load_rt(spec)
    elif source == "hub":
        dd = _load_hub(spec)
    else:
        if not data_dir:
            raise AclLabError(
                f"Source 'local' needs a GLUE folder but data_dir is not set. Fix: pass "
                f"--data-dir <dir> where <dir>/{spec.glue_dir}/train.tsv exists, or use --task {DEFAULT_TASK}."
            )
        dd = _load_local(spec, Path(data_dir))
    return datasets.DatasetDict({
        name: _subsample(split, max_train_samples, seed) if name == "train"
        else _subsample(split, max_eval_samples, SPLIT_SEED)
        for name, split in dd.items()
    })


# --------------------------------------------------------------------------- hub

def _load_hub(spec: TaskSpec) -> datasets.DatasetDict:
    """GLUE from the Hugging Face hub; any failure becomes an :class:`AclLabError` naming the offline options."""
    try:
        reason = hub_unreachable_reason()
        if reason:
            raise ConnectionError(reason)
        raw = datasets.load_dataset(HUB_DATASET, spec.hub_name)
    except Exception as exc:  # noqa: BLE001 - network, auth, cache and parsing errors all mean "hub failed"
        raise AclLabError(
            f"Loading GLUE task {spec.name!r} from the Hugging Face hub ({HUB_DATASET}) failed: "
            f"{type(exc).__name__}: {str(exc)[:300]}. The hub may be unreachable (no internet). "
            f"Fix: use the offline default `--task {DEFAULT_TASK}`, or download GLUE and pass "
            f"`--data-dir <dir with {spec.glue_dir}/train.tsv, {spec.glue_dir}/"
            f"{dict(spec.tsv_files)['dev']}>` (GLUE's original TSV layout)."
        ) from exc
    renames = {field: col for field, col in zip(spec.text_fields, ("text_a", "text_b"))}
    features = _features(spec)
    out = {}
    for split, hub_split in spec.hub_splits:
        ds = raw[hub_split].select_columns([*spec.text_fields, "label"]).rename_columns(renames)
        out[split] = ds.cast(features)
    return datasets.DatasetDict(out)


# ------------------------------------------------------------------------- local

def _read_tsv(spec: TaskSpec, path: Path) -> pd.DataFrame:
    """Read one GLUE TSV into columns text_a[, text_b], label, _line (1-based line in the file).

    Lines with too many fields and rows with an empty text or label are skipped
    with one warning (GLUE's QQP train file has a few such lines); a wrong
    header, an unknown label or a file with no usable rows raises.
    """
    if not path.is_file():
        raise AclLabError(
            f"GLUE file {path} not found (task {spec.name!r} expects {spec.glue_dir}/"
            f"{', '.join(f for _, f in spec.tsv_files)} in GLUE's original layout). "
            f"Fix: point --data-dir at the folder that contains {spec.glue_dir}/, "
            f"or use the offline default --task {DEFAULT_TASK}."
        )
    read_kw = dict(sep="\t", quoting=csv.QUOTE_NONE, dtype=str, keep_default_na=False,
                   encoding="utf-8-sig", on_bad_lines="warn", skip_blank_lines=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", pd.errors.ParserWarning)
        try:
            df = pd.read_csv(path, header=0 if spec.tsv_header else None, **read_kw)
        except pd.errors.EmptyDataError:
            df = pd.DataFrame()
        except UnicodeDecodeError as exc:
            raise AclLabError(f"GLUE file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}). Fix: "
                              f"re-download GLUE's original {spec.glue_dir} files, or save the file as UTF-8.") from None
    bad_lines = sorted(int(m.group(1)) for w in caught
                       if (m := re.search(r"Skipping line (\d+)", str(w.message))))
    if df.empty and not bad_lines:
        raise AclLabError(
            f"GLUE file {path} is empty (no data rows). Fix: re-download {spec.glue_dir} or "
            f"restore {path.name}; task {spec.name!r} needs rows in train and dev."
        )
    if spec.tsv_header:
        df.columns = [str(c).strip() for c in df.columns]
        expected = [*spec.tsv_text_columns, spec.tsv_label_column]
        missing = [c for c in expected if c not in df.columns]
        layout = f"a header line with columns {expected}"
    else:
        missing = [] if df.shape[1] == len(spec.tsv_names) else list(spec.tsv_names)
        if not missing:
            df.columns = list(spec.tsv_names)
        expected = list(spec.tsv_names)
        layout = f"no header line and exactly {len(expected)} tab-separated columns {expected}"
    if missing:
        found = list(df.columns) if spec.tsv_header else f"{df.shape[1]} columns"
        raise AclLabError(
            f"GLUE file {path} has the wrong columns for task {spec.name!r}: expected {layout}; found {found}. "
            f"Fix: use GLUE's original {spec.glue_dir} files (not a converted copy), or the matching --task."
        )
    first_line = 2 if spec.tsv_header else 1
    bad = set(bad_lines)
    lines = [n for n in range(first_line, first_line + len(df) + len(bad)) if n not in bad]
    out = pd.DataFrame({"_line": lines[:len(df)]})
    for new, col in zip(("text_a", "text_b"), spec.tsv_text_columns):
        out[new] = df[col].str.strip().to_numpy()
    out["label"] = df[spec.tsv_label_column].str.strip().to_numpy()
    incomplete = (out.drop(columns="_line") == "").any(axis=1)
    skipped = sorted(bad | set(out.loc[incomplete, "_line"]))
    out = out[~incomplete]
    if skipped:
        shown = ", ".join(map(str, skipped[:_MAX_LINES_SHOWN])) + (", ..." if len(skipped) > _MAX_LINES_SHOWN else "")
        warnings.warn(f"{path}: skipped {len(skipped)} malformed line(s) (wrong number of fields or an empty "
                      f"text/label): line(s) {shown}.", UserWarning, stacklevel=3)
    if out.empty:
        raise AclLabError(
            f"GLUE file {path} has no usable rows ({len(skipped)} malformed line(s) skipped). "
            f"Fix: re-download GLUE's original {spec.glue_dir} files."
        )
    out["label"] = [_parse_label(spec, path, line, raw) for line, raw in zip(out["_line"], out["label"])]
    return out


def _parse_label(spec: TaskSpec, path: Path, line: int, raw: str) -> int | float:
    """Map a label string from a TSV to a class id (or a float score for stsb), raising on unknown labels."""
    if spec.is_regression:
        low, high = spec.label_range
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:
            raise bad_value(f"{path}, line {line}: score", raw, f"a number from {low:g} to {high:g}",
                            f"fix or remove that line; {spec.name} scores are similarity ratings "
                            f"in [{low:g}, {high:g}].")
        return value
    if raw not in spec.tsv_label_values:
        allowed = ", ".join(f"{v!r} ({n})" for v, n in zip(spec.tsv_label_values, spec.label_names))
        raise bad_value(f"{path}, line {line}: label", raw, allowed,
                        f"fix or remove that line, or check that the file belongs to task {spec.name!r}.")
    return spec.tsv_label_values.index(raw)


def _load_local(spec: TaskSpec, data_dir: Path) -> datasets.DatasetDict:
    """GLUE's original TSV files under ``<data_dir>/<glue_dir>/``."""
    folder = data_dir / spec.glue_dir
    if not folder.is_dir():
        raise AclLabError(
            f"GLUE folder {folder} not found for task {spec.name!r}. Fix: pass --data-dir <dir> where "
            f"<dir>/{spec.glue_dir}/{spec.tsv_files[0][1]} exists (GLUE's original layout), "
            f"or use the offline default --task {DEFAULT_TASK}."
        )
    features = _features(spec)
    out = {}
    for split, filename in spec.tsv_files:
        df = _read_tsv(spec, folder / filename).drop(columns="_line")
        out[split] = datasets.Dataset.from_pandas(df, features=features, preserve_index=False)
    return datasets.DatasetDict(out)


# ---------------------------------------------------------------------------- RT

def normalise_text(text: str) -> str:
    """Lower-case and collapse whitespace: the key used to find duplicate texts."""
    return " ".join(text.lower().split())


def _load_rt(spec: TaskSpec) -> datasets.DatasetDict:
    """The Rotten Tomatoes corpus, cleaned, split 80/10/10 with :data:`SPLIT_SEED`, stratified by label.

    Texts are stripped; empty ones dropped. Texts that occur (after
    :func:`normalise_text`) under more than one of the task's categories are
    dropped entirely, since they have no single right label; remaining
    duplicates keep their first occurrence, so no text can land in two splits.
    """
    df = pd.read_csv(rt_corpus_path(), usecols=["category", "text"], dtype=str, keep_default_na=False)
    df = df[df["category"].isin(spec.label_names)].copy()
    df["text"] = df["text"].str.strip()
    df = df[df["text"] != ""]
    df["key"] = df["text"].map(normalise_text)
    conflicting = df.groupby("key")["category"].transform("nunique") > 1
    df = df[~conflicting].drop_duplicates("key")
    labels = df["category"].map(spec.label_names.index).to_numpy()
    texts = df["text"].to_numpy()
    idx = np.arange(len(df))
    train_idx, rest_idx = train_test_split(idx, test_size=0.2, random_state=SPLIT_SEED, stratify=labels)
    dev_idx, test_idx = train_test_split(rest_idx, test_size=0.5, random_state=SPLIT_SEED,
                                         stratify=labels[rest_idx])
    features = _features(spec)
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict(
            {"text_a": texts[np.sort(rows)].tolist(), "label": labels[np.sort(rows)].tolist()},
            features=features)
        for split, rows in (("train", train_idx), ("dev", dev_idx), ("test", test_idx))
    })


# ------------------------------------------------------------------ tokenization

def tokenize(dataset_dict: datasets.DatasetDict, tokenizer: PreTrainedTokenizerBase,
             max_length: int) -> datasets.DatasetDict:
    """Encode every split: ``input_ids``, ``attention_mask``, ``token_type_ids`` (if the tokenizer
    makes them) and ``labels``; truncated to ``max_length`` tokens, not padded.

    Pairs are encoded as ``tokenizer(text_a, text_b)``, so BERT sees
    ``[CLS] a [SEP] b [SEP]`` with segment ids 0/1. Padding is left to
    :func:`make_loader`, which pads each batch only as far as it needs.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise bad_value("max_length", max_length, "a positive integer (tokens per example, e.g. 128)",
                        "pass max_length=128 (GLUE default) or another positive number.")

    def encode(batch: dict) -> dict:
        pair = (batch["text_b"],) if "text_b" in batch else ()
        enc = tokenizer(batch["text_a"], *pair, truncation=True, max_length=max_length)
        enc["labels"] = batch["label"]
        return dict(enc)

    return datasets.DatasetDict({
        name: split.map(encode, batched=True, remove_columns=split.column_names, desc=f"tokenize {name}")
        for name, split in dataset_dict.items()
    })


def make_loader(encoded_split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, batch_size: int,
                shuffle: bool, seed: int = 0, group_by_length: bool = False) -> DataLoader:
    """A ``DataLoader`` over a :func:`tokenize`-d split with dynamic padding.

    Each batch is a dict of tensors (``input_ids``, ``attention_mask``,
    ``token_type_ids`` when present, ``labels``) padded to the longest example
    in that batch. Shuffling uses a ``torch.Generator`` seeded with ``seed``,
    so the batch order is reproducible.

    ``group_by_length`` (with ``shuffle``) draws the order with Hugging Face's
    ``LengthGroupedSampler`` (what ``Trainer`` uses for ``group_by_length``): a
    seeded random permutation cut into mega-batches of up to 50 batches, each
    sorted by length, so a batch holds examples of similar length and pads
    less. The order is still a function of ``seed`` alone, so a run resumed
    part-way through an epoch (the trainer rebuilds the loader and skips the
    batches already seen) sees the same batches.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise bad_value("batch_size", batch_size, "a positive integer (e.g. 32)",
                        "pass batch_size=32 or smaller if memory is short.")
    if "input_ids" not in encoded_split.column_names or "labels" not in encoded_split.column_names:
        raise AclLabError(
            f"make_loader needs a tokenized split (columns input_ids, labels); got columns "
            f"{encoded_split.column_names}. Fix: run data.tokenize(dataset_dict, tokenizer, max_length) first."
        )
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    collate = DataCollatorWithPadding(tokenizer)
    if group_by_length:
        if not shuffle:
            raise bad_value("group_by_length", True, "True only with shuffle=True (a training loader)",
                            "drop group_by_length for evaluation loaders, which keep the split's order.")
        from transformers.trainer_pt_utils import LengthGroupedSampler

        lengths = [len(ids) for ids in encoded_split["input_ids"]]
        sampler = LengthGroupedSampler(batch_size, lengths=lengths, generator=generator)
        # the loader draws its worker base seed from its own generator, never from the global RNG (resume)
        return DataLoader(encoded_split, batch_size=batch_size, sampler=sampler, collate_fn=collate,
                          generator=torch.Generator().manual_seed(seed))
    return DataLoader(encoded_split, batch_size=batch_size, shuffle=shuffle, generator=generator, collate_fn=collate)
