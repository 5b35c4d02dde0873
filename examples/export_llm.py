"""Export a decoder language model to ONNX with its KV cache, the way Optimum's ``text-generation-with-past``
export lays it out: ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.N.key|value`` in;
``logits``, ``present.N.key|value`` out; batch, sequence and past lengths symbolic. ``torch.onnx.export``
(the TorchScript exporter, ``dynamo=False``), opset 17. Nothing is downloaded. Runs in the export
environment (``.venv-export``: torch and transformers):

    .venv-export/bin/python examples/export_llm.py tiny-llama -o tiny.onnx         # random weights, seed 0
    .venv-export/bin/python examples/export_llm.py tiny-qwen2 -o tiny-qwen2.onnx
    .venv-export/bin/python examples/export_llm.py gguf --gguf SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.onnx

``gguf`` loads the file with ``transformers`` (which dequantizes it; needs the ``gguf`` package) and also
writes its tokenizer (``tokenizer.json``) beside the model. ``--save-hf DIR`` also writes the dequantized weights as
a Hugging Face checkpoint (``config.json``, ``model.safetensors``, the tokenizer): what ONNX Runtime GenAI's model
builder reads (``benchmarks/llm_compare.py``), so that both are built from the same weights. Prints one JSON line: {"path", "parameters",
"layers", "seconds"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

# The export environment's torchvision is installed without its dependencies beside a CPU torch (scripts/setup.sh),
# so its operators do not load, and transformers imports it whenever it is found: hidden from this process.
sys.modules.setdefault("torchvision", None)

OPSET = 17
# Tiny random configurations of each layout: Llama (and SmolLM: the same architecture), Qwen2 (q/k/v biases),
# Phi-3 (fused q/k/v and gate/up projections). Grouped-query attention (2 KV heads for 4), tied embeddings where
# the family ties them. initializer_range 0.2 spreads the logits, so greedy decoding does not repeat one token.
TINY = {
    "tiny-llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "tiny-qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "tiny-phi3": ("Phi3Config", dict(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
TINY_SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                  initializer_range=0.2)


def tiny_model(kind: str, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    config_class, extra = TINY[kind]
    config = getattr(transformers, config_class)(**TINY_SHAPE, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def gguf_model(path: Path, out_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype="float32").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out_dir))
    return model


def save_checkpoint(model, gguf: Path, out_dir: Path) -> None:
    """``model`` (loaded from ``gguf``) as a plain float32 Hugging Face checkpoint: transformers refuses to save a
    model it loaded from GGUF, so its weights go into a fresh model of the same configuration."""
    import transformers

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype="float32")
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(str(out_dir))
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out_dir))


class WithPast:
    """The model as a function of flat tensors: (input_ids, attention_mask, position_ids, *past) -> (logits, *present)."""

    def __new__(cls, model):
        import torch
        from transformers import DynamicCache

        layers = model.config.num_hidden_layers

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, position_ids, *past):
                cache = DynamicCache(config=model.config)
                for i in range(layers):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, use_cache=True)
                present = []
                for layer in out.past_key_values.layers[:layers]:
                    present += [layer.keys, layer.values]
                return (out.logits, *present)

        return Wrapped()


def export(model, path: Path) -> int:
    import torch

    config = model.config
    layers = config.num_hidden_layers
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    seq, past = 3, 5
    ids = torch.randint(0, config.vocab_size, (1, seq))
    mask = torch.ones(1, past + seq, dtype=torch.int64)
    positions = torch.arange(past, past + seq).unsqueeze(0)
    cache = [torch.randn(1, kv_heads, past, head_dim) for _ in range(2 * layers)]
    inputs, outputs = ["input_ids", "attention_mask", "position_ids"], ["logits"]
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"}}
    for i in range(layers):
        for kv in ("key", "value"):
            inputs.append(f"past_key_values.{i}.{kv}")
            axes[inputs[-1]] = {0: "batch_size", 2: "past_sequence_length"}
            outputs.append(f"present.{i}.{kv}")
            axes[outputs[-1]] = {0: "batch_size", 2: "total_sequence_length"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(WithPast(model), (ids, mask, positions, *cache), str(path), input_names=inputs,
                          output_names=outputs, dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=[*TINY, "gguf"])
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, help="the GGUF file (kind gguf)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-hf", type=Path, metavar="DIR", help="kind gguf: also save the weights as a Hugging Face "
                                                                    "checkpoint in DIR (float32)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.kind == "gguf":
        if args.gguf is None or not args.gguf.is_file():
            parser.error("gguf needs --gguf FILE.gguf (an existing file)")
        model = gguf_model(args.gguf, args.output.parent)
    else:
        model = tiny_model(args.kind, args.seed)
    parameters = export(model, args.output)
    if args.kind == "gguf" and args.save_hf is not None:
        save_checkpoint(model, args.gguf, args.save_hf)
    print(json.dumps({"path": str(args.output), "parameters": parameters, "layers": model.config.num_hidden_layers,
                      "seconds": round(time.perf_counter() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
