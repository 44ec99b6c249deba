"""Data loading: local GLUE TSVs (written here in GLUE's original layout), the RT
splits, hub failure handling (monkeypatched, never the real hub), tokenization
and dynamic-padding loaders."""
from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from acl_lab import data
from acl_lab.assets import model_dir
from acl_lab.data import load_task, make_loader, normalise_text, tokenize
from acl_lab.errors import AclLabError


def write_glue(root: Path, folder: str, files: dict[str, list[str]]) -> Path:
    """Write GLUE-style TSV files (one list of tab-joined lines per file) under root/folder."""
    (root / folder).mkdir(parents=True, exist_ok=True)
    for name, lines in files.items():
        (root / folder / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return root


SST2_TRAIN = ["sentence\tlabel", "a gorgeous , witty film \t1", '"quoted start and no end\t0',
              "dull as dishwater\t0"]
SST2_DEV = ["sentence\tlabel", "it 's a charming journey\t1"]


@pytest.fixture
def sst2_dir(tmp_path: Path) -> Path:
    return write_glue(tmp_path, "SST-2", {"train.tsv": SST2_TRAIN, "dev.tsv": SST2_DEV})


# ----------------------------------------------------------------- local GLUE

def test_local_sst2_header(sst2_dir):
    dd = load_task("sst2", data_dir=str(sst2_dir))
    assert set(dd) == {"train", "dev"}
    assert dd["train"].column_names == ["text_a", "label"]
    assert dd["train"]["text_a"] == ["a gorgeous , witty film", '"quoted start and no end', "dull as dishwater"]
    assert dd["train"]["label"] == [1, 0, 0]
    assert dd["train"].features["label"].names == ["negative", "positive"]
    assert len(dd["dev"]) == 1


def test_local_cola_no_header(tmp_path):
    train = ["gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.",
             "gj04\t0\t*\tThey drank the pub.",
             "bc01\t1\t\tThe more we study verbs, the crazier they get."]
    dev = ["gj04\t0\t*\tThe more you eat, the less he wants."]
    dd = load_task("cola", source="local", data_dir=str(write_glue(tmp_path, "CoLA",
                                                                    {"train.tsv": train, "dev.tsv": dev})))
    assert len(dd["train"]) == 3 and len(dd["dev"]) == 1
    assert dd["train"]["text_a"][1] == "They drank the pub."
    assert dd["train"]["label"] == [1, 0, 1] and dd["dev"]["label"] == [0]


def test_local_rte_string_labels(tmp_path):
    header = "index\tsentence1\tsentence2\tlabel"
    train = [header, "0\tA man is sleeping.\tA person rests.\tentailment",
             "1\tDogs bark.\tCats bark.\tnot_entailment"]
    dev = [header, "0\tIt rains.\tThe ground is dry.\tnot_entailment"]
    dd = load_task("rte", data_dir=str(write_glue(tmp_path, "RTE", {"train.tsv": train, "dev.tsv": dev})))
    assert dd["train"].column_names == ["text_a", "text_b", "label"]
    assert dd["train"]["text_b"] == ["A person rests.", "Cats bark."]
    assert dd["train"]["label"] == [0, 1] and dd["dev"]["label"] == [1]


def test_local_mrpc_pairs_with_bom_header(tmp_path):
    header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    train = [header, "1\t702876\t702977\tAmrozi accused his brother.\tReferring to him, Amrozi accused his brother.",
             "0\t2108705\t2108831\tYucaipa owned Dominick 's.\tYucaipa bought Dominick 's in 1995."]
    dev = [header, "1\t1089874\t1089925\tHe said so.\tSo he said."]
    dd = load_task("mrpc", data_dir=str(write_glue(tmp_path, "MRPC", {"train.tsv": train, "dev.tsv": dev})))
    assert dd["train"]["text_a"][0] == "Amrozi accused his brother."
    assert dd["train"]["text_b"][1] == "Yucaipa bought Dominick 's in 1995."
    assert dd["train"]["label"] == [1, 0]


MNLI_TRAIN_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                     "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label")
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER.replace("label1\tgold_label", "label1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label")


def mnli_row(i: int, s1: str, s2: str, gold: str, dev: bool) -> str:
    labels = [gold] * (5 if dev else 1)
    return "\t".join([str(i), "31193", f"{i}n", "government", "( x )", "( y )", "(ROOT x)", "(ROOT y)", s1, s2,
                      *labels, gold])


def test_local_mnli_matched_and_mismatched(tmp_path):
    files = {
        "train.tsv": [MNLI_TRAIN_HEADER, mnli_row(0, "P0", "H0", "neutral", False),
                      mnli_row(1, "P1", "H1", "contradiction", False)],
        "dev_matched.tsv": [MNLI_DEV_HEADER, mnli_row(0, "Pm", "Hm", "entailment", True)],
        "dev_mismatched.tsv": [MNLI_DEV_HEADER, mnli_row(0, "Px", "Hx", "contradiction", True),
                               mnli_row(1, "Py", "Hy", "neutral", True)],
    }
    dd = load_task("mnli", data_dir=str(write_glue(tmp_path, "MNLI", files)))
    assert set(dd) == {"train", "dev", "dev_mismatched"}
    assert dd["train"]["label"] == [1, 2]
    assert dd["dev"]["text_a"] == ["Pm"] and dd["dev"]["label"] == [0]
    assert dd["dev_mismatched"]["text_b"] == ["Hx", "Hy"] and dd["dev_mismatched"]["label"] == [2, 1]


STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"


def stsb_row(i: int, s1: str, s2: str, score: str) -> str:
    return "\t".join([str(i), "main-captions", "MSRvid", "2012test", f"000{i}", "none", "none", s1, s2, score])


def test_local_stsb_float_scores(tmp_path):
    train = [STSB_HEADER, stsb_row(0, "A plane takes off.", "An air plane is taking off.", "5.000"),
             stsb_row(1, "A man plays a flute.", "A man plays a drum.", "1.6")]
    dev = [STSB_HEADER, stsb_row(0, "A man with a hat.", "A man wears a hat.", "3.8")]
    dd = load_task("stsb", data_dir=str(write_glue(tmp_path, "STS-B", {"train.tsv": train, "dev.tsv": dev})))
    assert dd["train"]["label"] == pytest.approx([5.0, 1.6])
    assert dd["dev"]["label"] == pytest.approx([3.8])
    assert dd["train"]["text_b"][0] == "An air plane is taking off."


def test_local_malformed_lines_skipped_with_warning(tmp_path):
    header = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"
    train = [header, "0\t1\t2\tHow?\tWhy?\t0",
             "1\t3\t4\tbroken line with a\ttab too many\t\t1\textra",  # line 3: too many fields
             "2\t5\t6\tonly one question",  # line 4: too few fields -> empty question2/label
             "3\t7\t8\tWhat?\tWhat!\t1"]
    dev = [header, "0\t1\t2\tA?\tB?\t1"]
    root = write_glue(tmp_path, "QQP", {"train.tsv": train, "dev.tsv": dev})
    with pytest.warns(UserWarning, match=r"skipped 2 malformed line\(s\).*line\(s\) 3, 4"):
        dd = load_task("qqp", data_dir=str(root))
    assert dd["train"]["text_a"] == ["How?", "What?"] and dd["train"]["label"] == [0, 1]


def test_subsampling_is_seeded(tmp_path):
    train = ["sentence\tlabel"] + [f"sentence number {i}\t{i % 2}" for i in range(40)]
    dev = ["sentence\tlabel"] + [f"dev sentence {i}\t{i % 2}" for i in range(20)]
    root = write_glue(tmp_path, "SST-2", {"train.tsv": train, "dev.tsv": dev})
    a = load_task("sst2", data_dir=str(root), max_train_samples=10, seed=1, max_eval_samples=5)
    b = load_task("sst2", data_dir=str(root), max_train_samples=10, seed=1, max_eval_samples=5)
    c = load_task("sst2", data_dir=str(root), max_train_samples=10, seed=2, max_eval_samples=5)
    assert len(a["train"]) == 10 and len(a["dev"]) == 5
    assert a["train"]["text_a"] == b["train"]["text_a"] != c["train"]["text_a"]
    assert a["dev"]["text_a"] == c["dev"]["text_a"]  # eval subset does not depend on the training seed
    assert len(load_task("sst2", data_dir=str(root), max_train_samples=1000)["train"]) == 40
    with pytest.raises(AclLabError, match="max_train_samples"):
        load_task("sst2", data_dir=str(root), max_train_samples=0)


# ------------------------------------------------------------------ bad input

def test_missing_folder_and_file_name_the_path(tmp_path, sst2_dir):
    with pytest.raises(AclLabError) as err:
        load_task("rte", data_dir=str(tmp_path))
    assert str(tmp_path / "RTE") in str(err.value) and "--data-dir" in str(err.value)
    (sst2_dir / "SST-2" / "dev.tsv").unlink()
    with pytest.raises(AclLabError) as err:
        load_task("sst2", data_dir=str(sst2_dir))
    assert str(sst2_dir / "SST-2" / "dev.tsv") in str(err.value)


def test_wrong_columns(tmp_path):
    root = write_glue(tmp_path, "SST-2", {"train.tsv": ["text\ttarget", "good\t1"], "dev.tsv": SST2_DEV})
    with pytest.raises(AclLabError) as err:
        load_task("sst2", data_dir=str(root))
    msg = str(err.value)
    assert "['sentence', 'label']" in msg and "['text', 'target']" in msg
    cola = write_glue(tmp_path, "CoLA", {"train.tsv": ["a sentence\t1"], "dev.tsv": ["x\t1"]})
    with pytest.raises(AclLabError, match="exactly 4 tab-separated columns.*found 2 columns"):
        load_task("cola", data_dir=str(cola))


def test_label_outside_set_names_label_line_and_allowed(tmp_path):
    header = "index\tsentence1\tsentence2\tlabel"
    train = [header, "0\ta\tb\tentailment", "1\tc\td\tcontradiction"]
    root = write_glue(tmp_path, "RTE", {"train.tsv": train, "dev.tsv": train})
    with pytest.raises(AclLabError) as err:
        load_task("rte", data_dir=str(root))
    msg = str(err.value)
    assert "'contradiction'" in msg and "line 3" in msg and "'not_entailment'" in msg and "train.tsv" in msg


def test_stsb_score_out_of_range(tmp_path):
    root = write_glue(tmp_path, "STS-B", {"train.tsv": [STSB_HEADER, stsb_row(0, "A.", "B.", "7.5")],
                                          "dev.tsv": [STSB_HEADER, stsb_row(0, "A.", "B.", "1")]})
    with pytest.raises(AclLabError, match=r"'7.5'.*from 0 to 5"):
        load_task("stsb", data_dir=str(root))


def test_empty_split_names_the_file(tmp_path):
    root = write_glue(tmp_path, "SST-2", {"train.tsv": SST2_TRAIN, "dev.tsv": ["sentence\tlabel"]})
    with pytest.raises(AclLabError, match=r"dev\.tsv is empty"):
        load_task("sst2", data_dir=str(root))
    (root / "SST-2" / "dev.tsv").write_text("")
    with pytest.raises(AclLabError, match=r"dev\.tsv is empty"):
        load_task("sst2", data_dir=str(root))


def test_bad_task_and_source():
    with pytest.raises(AclLabError, match="rt-polarity"):
        load_task("imdb")
    with pytest.raises(AclLabError, match="'web'"):
        load_task("rt-polarity", source="web")
    with pytest.raises(AclLabError, match="offline Rotten Tomatoes"):
        load_task("rt-polarity", source="hub")
    with pytest.raises(AclLabError, match="data_dir is not set"):
        load_task("sst2", source="local")


def test_hub_failure_is_wrapped(monkeypatch):
    def fail(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(AclLabError) as err:
        load_task("sst2")  # auto + no data_dir -> hub
    msg = str(err.value)
    assert "--task rt-polarity" in msg and "--data-dir" in msg and "SST-2/train.tsv" in msg
    assert "ConnectionError" in msg


def test_hub_layout_is_mapped(monkeypatch):
    """The hub path renames GLUE's columns without touching the network (load_dataset is faked)."""
    monkeypatch.setattr("acl_lab.data.hub_unreachable_reason", lambda: None)
    feats = datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                               "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
                               "idx": datasets.Value("int32")})

    def split(n: int) -> datasets.Dataset:
        return datasets.Dataset.from_dict({"premise": [f"p{i}" for i in range(n)], "hypothesis": ["h"] * n,
                                           "label": [i % 3 for i in range(n)], "idx": list(range(n))}, features=feats)

    fake = datasets.DatasetDict({"train": split(4), "validation_matched": split(2),
                                 "validation_mismatched": split(3), "test_matched": split(1)})
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or fake)
    dd = load_task("mnli", source="hub")
    assert calls == [(data.HUB_DATASET, "mnli")]
    assert {k: len(v) for k, v in dd.items()} == {"train": 4, "dev": 2, "dev_mismatched": 3}
    assert dd["train"].column_names == ["text_a", "text_b", "label"]
    assert dd["train"]["text_a"] == ["p0", "p1", "p2", "p3"] and dd["train"]["label"] == [0, 1, 2, 0]


# ------------------------------------------------------------------- RT tasks

@pytest.fixture(scope="module")
def rt_polarity() -> datasets.DatasetDict:
    return load_task("rt-polarity")


def test_rt_polarity_splits(rt_polarity):
    dd = rt_polarity
    assert set(dd) == {"train", "dev", "test"}
    sizes = {k: len(v) for k, v in dd.items()}
    total = sum(sizes.values())
    assert 11_000 <= total <= 12_808
    assert sizes["train"] == pytest.approx(0.8 * total, abs=2)
    assert sizes["dev"] == pytest.approx(0.1 * total, abs=2)
    keys = {k: [normalise_text(t) for t in v["text_a"]] for k, v in dd.items()}
    assert sum(len(set(v)) for v in keys.values()) == total  # no duplicates inside a split
    assert len(set().union(*keys.values())) == total  # ... nor across splits
    assert all(t == t.strip() and t for v in dd.values() for t in v["text_a"])
    for split in dd.values():  # stratified: fresh share about the same everywhere
        assert sum(split["label"]) / len(split) == pytest.approx(7_403 / 12_808, abs=0.02)


def test_rt_split_is_deterministic_and_seed_independent(rt_polarity):
    again = load_task("rt-polarity", seed=7)
    for name in rt_polarity:
        assert again[name]["text_a"] == rt_polarity[name]["text_a"]
        assert again[name]["label"] == rt_polarity[name]["label"]


def test_rt_3way():
    dd = load_task("rt-3way", max_eval_samples=50)
    assert dd["train"].features["label"].names == ["rotten", "fresh", "plot"]
    assert set(dd["train"]["label"]) == {0, 1, 2}
    assert len(dd["dev"]) == len(dd["test"]) == 50
    assert 10_500 <= len(dd["train"]) <= 0.8 * 13_905  # 80% of the deduplicated corpus


# ------------------------------------------------------- tokenize and loaders

@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(model_dir()))


def _pair_dd() -> datasets.DatasetDict:
    return datasets.DatasetDict({"train": datasets.Dataset.from_dict({
        "text_a": ["short one", "a much longer first sentence with many more words in it", "mid size text"],
        "text_b": ["b", "second", "another second sentence"],
        "label": [0, 1, 0]})})


def test_tokenize_no_padding_and_truncation(tokenizer):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"text_a": ["hi", "word " * 100], "label": [1, 0]})})
    enc = tokenize(dd, tokenizer, max_length=16)["train"]
    assert set(enc.column_names) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    lengths = [len(ids) for ids in enc["input_ids"]]
    assert lengths == [3, 16]  # [CLS] hi [SEP] is not padded; the long one is cut at max_length
    assert enc["labels"] == [1, 0]


def test_pairs_have_segment_ids(tokenizer):
    enc = tokenize(_pair_dd(), tokenizer, max_length=64)["train"]
    first = enc[0]
    assert tokenizer.convert_ids_to_tokens(first["input_ids"]) == ["[CLS]", "short", "one", "[SEP]", "b", "[SEP]"]
    assert first["token_type_ids"] == [0, 0, 0, 0, 1, 1]


def test_loader_pads_dynamically(tokenizer):
    enc = tokenize(_pair_dd(), tokenizer, max_length=128)["train"]
    longest = max(len(ids) for ids in enc["input_ids"])
    batch = next(iter(make_loader(enc, tokenizer, batch_size=3, shuffle=False)))
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert batch["input_ids"].shape == (3, longest) and longest < 128
    assert batch["attention_mask"].sum(1).tolist() == [len(ids) for ids in enc["input_ids"]]
    assert batch["token_type_ids"].max().item() == 1
    assert batch["labels"].tolist() == [0, 1, 0] and batch["labels"].dtype == torch.long
    small = next(iter(make_loader(enc.select([0]), tokenizer, batch_size=3, shuffle=False)))
    assert small["input_ids"].shape == (1, len(enc["input_ids"][0]))


def test_loader_shuffle_is_seeded(tokenizer):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"text_a": [f"text {i}" for i in range(20)], "label": [i % 2 for i in range(20)]})})
    enc = tokenize(dd, tokenizer, max_length=8)["train"]

    def order(seed: int) -> list[list[int]]:
        return [b["input_ids"][:, 2].tolist() for b in make_loader(enc, tokenizer, 5, shuffle=True, seed=seed)]

    assert order(3) == order(3) != order(4)


def test_stsb_labels_are_float(tokenizer):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"text_a": ["a", "b"], "text_b": ["c", "d"], "label": [4.2, 0.5]},
        features=data._features(data.get_task("stsb")))})
    batch = next(iter(make_loader(tokenize(dd, tokenizer, 8)["train"], tokenizer, 2, shuffle=False)))
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"].tolist() == pytest.approx([4.2, 0.5])


def test_bad_lengths_and_batch_sizes(tokenizer):
    with pytest.raises(AclLabError, match="max_length"):
        tokenize(_pair_dd(), tokenizer, max_length=0)
    enc = tokenize(_pair_dd(), tokenizer, max_length=8)["train"]
    with pytest.raises(AclLabError, match="batch_size"):
        make_loader(enc, tokenizer, batch_size=0, shuffle=False)
    with pytest.raises(AclLabError, match="tokenize"):
        make_loader(_pair_dd()["train"], tokenizer, batch_size=2, shuffle=False)


def test_length_grouped_loader_is_seeded_complete_and_pads_less(tokenizer):
    rng = np.random.default_rng(0)
    texts = [" ".join(["word"] * int(n)) + f" {i}" for i, n in enumerate(rng.integers(1, 40, size=200))]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text_a": texts, "label": [i % 2 for i in range(200)]})})
    enc = tokenize(dd, tokenizer, max_length=64)["train"]

    def batches(seed: int, grouped: bool) -> list[dict]:
        torch.manual_seed(seed + 99)  # the global RNG must not matter, only ``seed``
        return list(make_loader(enc, tokenizer, 8, shuffle=True, seed=seed, group_by_length=grouped))

    def order(bs: list[dict]) -> list[list[int]]:
        return [b["attention_mask"].sum(1).tolist() for b in bs]

    grouped = batches(3, True)
    assert order(grouped) == order(batches(3, True)) != order(batches(4, True))
    seen = sorted(tokenizer.decode(ids[mask.bool()]) for b in grouped for ids, mask in zip(b["input_ids"], b["attention_mask"]))
    assert seen == sorted(tokenizer.decode(ids) for ids in enc["input_ids"])  # every example once
    padding = lambda bs: sum(b["attention_mask"].numel() - b["attention_mask"].sum().item() for b in bs)
    assert padding(grouped) < 0.5 * padding(batches(3, False))
    with pytest.raises(AclLabError, match="group_by_length"):
        make_loader(enc, tokenizer, 8, shuffle=False, group_by_length=True)
