"""Serial tests of the BERT app's pieces (apps/bert): masking, tokenizer, corpus, shards, model, Task."""

import hashlib
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

APPS = Path(__file__).resolve().parents[1] / "apps"
SEQ_LEN, BATCH, SIZE, EVAL = 64, 16, 4, 64


@pytest.fixture(scope="module")
def bert():
    """The ``apps/bert`` package, imported the way the app scripts see it (``apps/`` on sys.path)."""
    if str(APPS) not in sys.path:
        sys.path.insert(0, str(APPS))
    return importlib.import_module("bert")


@pytest.fixture(scope="module")
def task(bert):
    """Rank 0 of 4 of the tiny preset on the embedded corpus (seq 64, batch 16, seed 0)."""
    return bert.build_task("tiny", None, None, SEQ_LEN, BATCH, 0, SIZE, 0, None, eval_sequences=EVAL)


@pytest.fixture(scope="module")
def split(bert):
    return bert.corpus.split_documents(bert.corpus.load_documents(None), bert.SPLIT_SEED, 0.1)


def eval_loss(task, model, batch):
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = float(task.loss(model, batch)[0])
    model.train(was)
    return loss


# ---------------------------------------------------------------------------------------------- masking

def test_masking_proportions_and_labels(bert):
    vocab, special = 500, [0, 1, 2, 3, 4]
    masker = bert.Masker(vocab, special, mask_id=4)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(5, vocab, (200, 256), generator=gen)
    ids[:, 0], ids[:, -1], ids[::3, 200:] = 2, 3, 0  # [CLS], [SEP], [PAD] tails
    original = ids.clone()
    inputs, labels = masker(ids, torch.Generator().manual_seed(7))
    assert torch.equal(ids, original)  # not modified in place
    is_special = torch.isin(ids, torch.tensor(special))
    selected = labels != bert.IGNORE_INDEX
    # specials never selected nor changed; labels are the originals exactly where selected, -100 elsewhere
    assert not (selected & is_special).any()
    assert torch.equal(inputs[is_special], ids[is_special])
    assert torch.equal(labels[selected], ids[selected])
    assert torch.equal(inputs[~selected], ids[~selected])
    # tolerance: 5 binomial standard deviations (fixed seeds, so the test is deterministic)
    n_plain, n_sel = int((~is_special).sum()), int(selected.sum())
    assert abs(n_sel / n_plain - 0.15) < 5 * math.sqrt(0.15 * 0.85 / n_plain)
    cands = vocab - len(special)
    frac_mask = float((inputs[selected] == 4).sum()) / n_sel
    changed = (inputs[selected] != ids[selected]) & (inputs[selected] != 4)
    frac_random = float(changed.sum()) / n_sel
    frac_same = float((inputs[selected] == ids[selected]).sum()) / n_sel
    for got, p in ((frac_mask, 0.8), (frac_random, 0.1 * (1 - 1 / cands)), (frac_same, 0.1 + 0.1 / cands)):
        assert abs(got - p) < 5 * math.sqrt(p * (1 - p) / n_sel), (got, p)
    # random replacements are never special tokens
    assert not torch.isin(inputs[selected & (inputs != 4)], torch.tensor(special)).any()
    # the generator state fully determines the masks
    again = masker(ids, torch.Generator().manual_seed(7))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)


def test_masker_rejects_bad_input(bert):
    with pytest.raises(ValueError, match="mask_id"):
        bert.Masker(100, [0, 1], mask_id=7)
    with pytest.raises(ValueError, match="rate"):
        bert.Masker(100, [0, 1], mask_id=1, rate=0.0)
    with pytest.raises(ValueError, match="special_ids"):
        bert.Masker(100, [0, 100], mask_id=0)
    with pytest.raises(TypeError, match="int64"):
        bert.Masker(100, [0, 1], mask_id=1)(torch.zeros(3, dtype=torch.int32), torch.Generator())


# -------------------------------------------------------------------------------------------- tokenizer

def test_tokenizer_deterministic_in_process_and_across_processes(bert, split):
    train_docs, _ = split
    first = bert.tokenizer.train_tokenizer(train_docs, 4000).to_str()
    second = bert.tokenizer.train_tokenizer(train_docs, 4000).to_str()
    assert first == second
    # a fresh process has fresh hash-map seeds: the upstream trainer alone differs here (tokenizers#1794)
    # (tokenizer.py alone is loaded there, from its path, and fed the documents as JSON on stdin)
    code = ("import hashlib, importlib.util, json, sys; "
            "spec = importlib.util.spec_from_file_location('tk', sys.argv[1]); "
            "tk = importlib.util.module_from_spec(spec); spec.loader.exec_module(tk); "
            "tok = tk.train_tokenizer(json.load(sys.stdin), 4000); "
            "print(hashlib.sha256(tok.to_str().encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code, str(APPS / "bert" / "tokenizer.py")],
                         input=json.dumps(train_docs), capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == hashlib.sha256(first.encode()).hexdigest()


def test_tokenizer_specials_round_trip_and_continuation_pieces(bert, task):
    tok = task.tokenizer
    assert [tok.token_to_id(t) for t in bert.tokenizer.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.get_vocab_size() == 4000
    for sentence in ("The quick brown fox jumps over the lazy dog.",
                     "Tokenizers split unfamiliar words into pieces."):
        enc = tok.encode(sentence)
        assert enc.ids[0] == tok.token_to_id("[CLS]") and enc.ids[-1] == tok.token_to_id("[SEP]")
        assert 1 not in enc.ids  # no [UNK]
        assert tok.decode(enc.ids) == sentence.lower()
    assert any(t.startswith("##") for t in tok.encode("Tokenizers split unfamiliar words").tokens)
    # every single-character continuation piece was fixed up front (ids right after the specials), so no
    # id was assigned in hash-map order
    seeded = [t for t, i in tok.get_vocab().items() if t.startswith("##") and len(t) == 3]
    alphabet_start = 5 + len(seeded)
    assert all(tok.token_to_id(t) < alphabet_start for t in seeded)


def test_tokenizer_save_load_cache_and_bad_files(bert, task, split, tmp_path):
    tk = bert.tokenizer
    path = tk.save_tokenizer(task.tokenizer, tmp_path / "tok.json")
    assert tk.load_tokenizer(path).to_str() == task.tokenizer.to_str()
    # cache: the first call writes out_dir/<cache_name>, the second loads that file
    train_docs, _ = split
    cache = tmp_path / "run"
    tok = tk.obtain_tokenizer(train_docs, 4000, cache_dir=cache)
    cached = cache / tk.cache_name(train_docs, 4000)
    assert cached.read_text(encoding="utf-8") == tok.to_str() == task.tokenizer.to_str()
    plain = tk.train_tokenizer(["alpha beta gamma " * 5, "beta gamma delta " * 5], 40)
    tk.save_tokenizer(plain, cached)  # a different tokenizer under the cache name: it is loaded, not retrained
    assert tk.obtain_tokenizer(train_docs, 4000, cache_dir=cache).to_str() == plain.to_str()
    assert tk.obtain_tokenizer(train_docs, 4000, path=path, cache_dir=cache).to_str() == task.tokenizer.to_str()
    with pytest.raises(ValueError, match="is not a file"):
        tk.load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not a tokenizers JSON"):
        tk.load_tokenizer(tmp_path / "bad.json")
    text = plain.to_str().replace('"[MASK]"', '"[MSK]"')
    (tmp_path / "nomask.json").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=r"lacks the special token\(s\) \[MASK\]"):
        tk.load_tokenizer(tmp_path / "nomask.json")
    with pytest.raises(ValueError, match="vocab-size"):
        tk.train_tokenizer(train_docs, 5)


# ----------------------------------------------------------------------------------------------- corpus

def test_default_corpus_and_split(bert, split):
    docs = bert.corpus.load_documents(None)
    assert len(docs) == 79 and sum(map(len, docs)) > 400_000
    train, val = split
    assert len(val) == round(0.1 * 79) and len(train) + len(val) == 79
    assert not set(train) & set(val) and set(train) | set(val) == set(docs)
    assert (train, val) == bert.corpus.split_documents(docs, bert.SPLIT_SEED, 0.1)
    assert val != bert.corpus.split_documents(docs, bert.SPLIT_SEED + 1, 0.1)[1]
    assert len(bert.corpus.split_documents(docs, 3, 0.05)[1]) == 4


def test_corpus_sources_and_errors(bert, tmp_path):
    load = bert.corpus.load_documents
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second file", encoding="utf-8")
    (folder / "sub" / "a.txt").write_text("third file", encoding="utf-8")
    (folder / "a.txt").write_text("first file", encoding="utf-8")
    (folder / "notes.md").write_text("ignored", encoding="utf-8")
    assert load(folder) == ["first file", "second file", "third file"]
    paragraphs = tmp_path / "one.txt"
    paragraphs.write_text("p one\nstill one\n\n  \np two\n", encoding="utf-8")
    assert load(str(paragraphs)) == ["p one\nstill one", "p two\n"]
    lines = tmp_path / "lines.txt"
    lines.write_text("line a\nline b\n\n", encoding="utf-8")
    assert load(lines) == ["line a", "line b"]
    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--data: no .txt files in"):
        load(tmp_path / "empty")
    (tmp_path / "blank.txt").write_text(" \n\n\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        load(tmp_path / "blank.txt")
    with pytest.raises(TypeError, match="--data"):
        load(3)
    with pytest.raises(ValueError, match="at least 2 documents"):
        bert.corpus.split_documents(["only one"], 0)


def test_pack_sequences_layout(bert, task):
    tok = task.tokenizer
    docs = ["alpha beta gamma delta " * 7, "epsilon zeta"]
    rows = bert.corpus.pack_sequences(tok, docs, 16)
    stream = tok.encode(docs[0], add_special_tokens=False).ids + [3] + tok.encode(docs[1], add_special_tokens=False).ids
    expected = [[2, *stream[i:i + 14], 3] for i in range(0, len(stream), 14)]
    expected[-1] += [0] * (16 - len(expected[-1]))  # [CLS] … [SEP] then [PAD]s, last row only
    assert rows.dtype == torch.int64 and rows.tolist() == expected
    with pytest.raises(ValueError, match="--seq-len"):
        bert.corpus.pack_sequences(tok, docs, 2)


def test_shards_disjoint_and_covering(bert):
    rows = torch.arange(1003 * 2).reshape(1003, 2)
    shards = [bert.corpus.shard(rows, r, SIZE) for r in range(SIZE)]
    firsts = torch.cat([s[:, 0] for s in shards])
    assert sorted(firsts.tolist()) == rows[:, 0].tolist()  # disjoint and covering
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError, match="rank"):
        bert.corpus.shard(rows, SIZE, SIZE)


# ------------------------------------------------------------------------------------------------ model

def test_model_init_deterministic_and_tiny_parameter_count(bert):
    rng = torch.get_rng_state()
    a = bert.build_model("tiny", 300, seed=5)
    b = bert.build_model("tiny", 300, seed=5)
    c = bert.build_model("tiny", 300, seed=6)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's generator is untouched
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    V, H, L, I, P = 300, 64, 2, 128, 128  # noqa: E741
    embeddings = V * H + P * H + 2 * H + 2 * H
    layer = 4 * (H * H + H) + 2 * H + (H * I + I) + (I * H + H) + 2 * H
    head = (H * H + H) + 2 * H + V  # decoder weight tied to the word embeddings
    assert sum(p.numel() for p in a.parameters()) == embeddings + L * layer + head
    assert a.cls.predictions.decoder.weight is a.bert.embeddings.word_embeddings.weight
    with pytest.raises(ValueError, match="--preset"):
        bert.build_model("huge", 300, seed=0)
    with pytest.raises(ValueError, match="--dropout"):
        bert.build_model("tiny", 300, seed=0, dropout=1.0)


# ------------------------------------------------------------------------------------------------- task

def test_task_batches_deterministic_and_resumable(bert, task):
    assert task.steps_per_epoch == len(task.train_sequences) // BATCH >= 20
    full = list(task.train_batches(1))
    assert len(full) == task.steps_per_epoch
    again = list(task.train_batches(1))
    tail = list(task.train_batches(1, start=7))
    for x, y in zip(full, again):
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert len(tail) == len(full) - 7
    for x, y in zip(full[7:], tail):
        assert all(torch.equal(x[k], y[k]) for k in x)
    batch = full[0]
    assert batch["input_ids"].shape == (BATCH, SEQ_LEN) and set(batch) == {"input_ids", "attention_mask", "labels"}
    other_epoch = next(task.train_batches(2))
    assert not torch.equal(other_epoch["labels"], batch["labels"])
    # batch b holds the shard's rows order[b*B:(b+1)*B] (labels put back), so an epoch visits distinct rows
    order = task.epoch_order(1)
    assert sorted(order.tolist()) == list(range(len(task.train_sequences)))
    for b, got in enumerate(full):
        original = torch.where(got["labels"] != -100, got["labels"], got["input_ids"])
        assert torch.equal(original, task.train_sequences[order[b * BATCH:(b + 1) * BATCH]])
        assert torch.equal(got["attention_mask"], (original != 0).long())
    with pytest.raises(ValueError, match="start"):
        task.train_batches(0, start=task.steps_per_epoch + 1)
    with pytest.raises(TypeError, match="epoch must be an integer"):
        task.train_batches(1.0)
    first = next(task.train_batches(np.int64(1), start=np.int64(7)))  # e.g. a position read back from HDF5
    assert torch.equal(first["labels"], full[7]["labels"])


def test_task_shards_of_all_ranks_cover_train_set(bert, task, split):
    # the shard is rank::size of the packed training sequences; rebuild those and compare
    packed = bert.corpus.pack_sequences(task.tokenizer, split[0], SEQ_LEN)
    assert torch.equal(task.train_sequences, packed[0::SIZE])
    assert task.steps_per_epoch == len(packed) // SIZE // BATCH


def test_loss_matches_huggingface_and_is_log_vocab_at_init(bert, task):
    model, batch = task.model, next(task.train_batches(0))
    model.eval()
    with torch.no_grad():
        loss, counts = task.loss(model, batch)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    model.train()
    assert abs(float(loss) - float(out.loss)) < 1e-5
    selected = batch["labels"] != -100
    assert counts["masked_tokens"] == int(selected.sum()) > 0
    assert counts["correct"] == int((out.logits.argmax(-1)[selected] == batch["labels"][selected]).sum())
    # at init the logits are ~N(0, s^2) with s ~ 0.02 * sqrt(64) = 0.16, so CE ~ log V + s^2 / 2 ~ log V + 0.013
    assert math.isfinite(float(loss)) and abs(float(loss) - math.log(4000)) < 0.1


def test_adam_steps_reduce_the_loss(bert, task):
    model = bert.build_model("tiny", 4000, seed=3)
    batch = {k: v[:4] for k, v in next(task.train_batches(0)).items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = [eval_loss(task, model, batch)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # dropout
        for _ in range(5):
            opt.zero_grad()
            task.loss(model, batch)[0].backward()
            opt.step()
            losses.append(eval_loss(task, model, batch))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.3, losses


def test_evaluate_fixed_and_equal_to_reference(bert, task):
    model = task.model
    model.train()
    first = task.evaluate(model)
    assert model.training  # mode restored
    assert first == task.evaluate(model)
    assert len(task.val_inputs) == EVAL
    model.eval()
    with torch.no_grad():
        out = model(input_ids=task.val_inputs, attention_mask=(task.val_inputs != 0).long(), labels=task.val_labels)
    model.train()
    selected = task.val_labels != -100
    accuracy = float((out.logits.argmax(-1)[selected] == task.val_labels[selected]).float().mean())
    assert abs(first["val_mlm_loss"] - float(out.loss)) < 1e-4
    assert abs(first["val_mlm_accuracy"] - accuracy) < 1e-9
    # the validation mask does not depend on the run's seed or rank
    other = bert.build_task("tiny", None, None, SEQ_LEN, BATCH, 2, SIZE, 9, 4000, eval_sequences=EVAL)
    assert torch.equal(other.val_inputs, task.val_inputs) and torch.equal(other.val_labels, task.val_labels)
    assert not torch.equal(other.train_sequences, task.train_sequences)


def test_build_task_rejects_bad_input(bert, task, tmp_path):
    good = dict(preset="tiny", data=None, tokenizer_path=None, seq_len=SEQ_LEN, batch_size=BATCH, rank=0,
                size=SIZE, seed=0, vocab_size=None)
    cases = [
        (dict(preset="huge"), "--preset"),
        (dict(seq_len=129), r"--seq-len must be in \[8, 128\], got 129"),
        (dict(seq_len=4), "--seq-len"),
        (dict(batch_size=0), "--batch-size"),
        (dict(rank=4), "rank"),
        (dict(seed=-1), "--seed"),
        (dict(data=tmp_path / "missing"), "does not exist"),
        (dict(tokenizer_path=tmp_path / "missing.json"), "--tokenizer"),
        (dict(batch_size=10_000), "--batch-size 10000 is larger than"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            bert.build_task(**{**good, **change})
    with pytest.raises(TypeError, match="BertForMaskedLM"):
        task.loss(torch.nn.Linear(2, 2), next(task.train_batches(0)))
