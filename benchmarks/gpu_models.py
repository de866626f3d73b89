"""Models for benchmarks/gpu_check.sh that need no network.

    python3 benchmarks/gpu_models.py random-1b DIR   # a random Llama-3.2-1B-shaped model (bf16, ~2.5 GB)
    python3 benchmarks/gpu_models.py random-smollm2 DIR  # random weights in SmolLM2-135M's shape (bf16)
    python3 benchmarks/gpu_models.py default         # prints the default model's directory, or why not

The random model has Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads / 8 KV heads of 64,
MLP 8192, vocab 128256, tied embeddings: 1.24 B parameters) and random weights: throughput depends
on the shape, not on the values. It is built on the GPU (seconds) and written once; a DIR that
already holds it is reused. The SmolLM2-shaped one stands in for the default model on a machine
without it (its GGUF is 98 MB, more than travels to a GPU machine without network): the bench's
workload ignores EOS, so its throughput is the default model's.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=True)
# SmolLM2-135M-Instruct's config.json (the default model), weights aside.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               tie_word_embeddings=True)
SHAPES = {"random-1b": LLAMA_1B, "random-smollm2": SMOLLM2}


def random_model(shape: dict, target: Path) -> Path:
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    import transformers

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).to(torch.bfloat16)
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(target)
    return target


def main(argv: list[str]) -> int:
    if argv[:1] and argv[0] in SHAPES and len(argv) == 2:
        print(random_model(SHAPES[argv[0]], Path(argv[1])))
        return 0
    if argv == ["default"]:
        from pagedrun.errors import PagedrunError
        from pagedrun.models.default_model import default_model_dir

        try:
            print(default_model_dir())
            return 0
        except PagedrunError as e:
            print(e)
            return 1
    print("usage:\n" + "\n".join(__doc__.strip().splitlines()[2:5]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
