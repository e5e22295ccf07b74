"""Deterministic random-weight models for tests and benchmarks, built offline.

No hub access exists where kvtier is developed and tested, so the models the
local stack serves are built here: a Llama layout with seeded random weights,
a byte-level BPE tokenizer trained on a generated corpus, and a chat template.
Builds are cached on disk (``~/.cache/kvtier/models/<name>`` unless
``KVTIER_MODEL_CACHE`` says otherwise) and are reproducible bit for bit.

Two presets:

- ``tiny``  (~3.5M params): e2e tests; fast to start, near-free prefill.
- ``bench`` (~90M params): benchmarks; prefill of a few thousand tokens costs
  real time on a 2-core CPU, so reuse has something to save.

Weights are stored in float16; the stack serves them in the dtype that suits the
CPU (``kvtier.devstack.stack.cpu_dtype``: float16 on AMX machines, where bfloat16 dies with
SIGILL, bfloat16 where the CPU has AVX-512 BF16, else float32), vLLM casting at load.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

# A ChatML-style template; tool results come back as role "tool".
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelPreset:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    seed: int = 0
    initializer_range: float = 0.02
    # Scale of the LM head. HF's init gives near-flat logits (top-2 often tie),
    # so greedy output would flip on the tiny numeric differences between a
    # recomputed and a transferred KV cache. A larger head makes the argmax
    # decisive, which is what the equality tests need.
    lm_head_std: float = 2.0


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("tiny", 4096, 256, 512, 4, 4, 2, 4096),
    "bench": ModelPreset("bench", 8192, 768, 2048, 12, 12, 4, 8192),
}


def cache_root() -> Path:
    return Path(os.environ.get("KVTIER_MODEL_CACHE", Path.home() / ".cache" / "kvtier" / "models"))


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Generated English-ish text plus chat/tool vocabulary, so BPE learns merges."""
    rng = random.Random(seed)
    words = (
        "the agent calls a tool and reads the result then asks the model again about "
        "files search query answer json error status request response token cache block "
        "prefill decode memory host device transfer latency history turn user assistant "
        "system function arguments output value list table row column index key time"
    ).split()
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        s = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            s += " " + json.dumps({rng.choice(words): rng.randint(0, 9999)})
        out.append(s)
    return out


def build_model(preset: str | ModelPreset = "tiny", dest: Path | None = None, force: bool = False) -> Path:
    """Build (or reuse the cached) model directory for ``preset`` and return its path."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    dest = dest or cache_root() / p.name
    stamp = dest / "kvtier-preset.json"
    if not force and stamp.exists() and json.loads(stamp.read_text()) == asdict(p):
        return dest
    # Heavy imports only when a build is needed.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    log.info("building model %s into %s", p.name, dest)
    dest.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=p.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(p.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)

    config = LlamaConfig(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings,
        initializer_range=p.initializer_range,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        dtype="float16",
    )
    torch.manual_seed(p.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, p.lm_head_std)
    model = model.to(torch.float16)
    model.save_pretrained(dest, safe_serialization=True)
    (dest / "generation_config.json").unlink(missing_ok=True)
    n_params = sum(t.numel() for t in model.parameters())
    stamp.write_text(json.dumps(asdict(p)))
    log.info("built %s: %.1fM parameters", p.name, n_params / 1e6)
    return dest


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvtier.devstack.models", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dest", type=Path, default=None)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_model(args.preset, args.dest, args.force))


if __name__ == "__main__":
    main()
