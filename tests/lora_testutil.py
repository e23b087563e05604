"""Random PEFT LoRA adapters for the test models, built with peft itself, and peft's reference outputs.

`init_lora_weights=False` gives B random values too (peft's default leaves B zero: an adapter that changes
nothing would pass any test), scaled up so each adapter moves the random model's greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    rank: int
    target_modules: tuple[str, ...]
    lora_alpha: int
    use_rslora: bool = False
    seed: int = 0


# Several ranks, target sets, alphas, and rsLoRA
SPECS = (
    AdapterSpec("qv-r4", 4, ("q_proj", "v_proj"), lora_alpha=8, seed=1),
    AdapterSpec("attn-r8", 8, ATTENTION, lora_alpha=16, seed=2),
    AdapterSpec("mlp-r16-rslora", 16, MLP, lora_alpha=8, use_rslora=True, seed=3),
    AdapterSpec("all-r2", 2, ATTENTION + MLP, lora_alpha=32, seed=4),
)


def build_adapter(model_dir: Path, out_dir: Path, spec: AdapterSpec) -> Path:
    """Saves a random LoRA adapter of `spec` on the model at `model_dir` (adapter_config.json +
    adapter_model.safetensors) under out_dir/spec.name; returns that directory."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    base: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                     dtype=torch.float32)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.lora_alpha, target_modules=list(spec.target_modules),
                        use_rslora=spec.use_rslora, init_lora_weights=False, lora_dropout=0.0,
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():  # larger than peft's init, so that the adapter changes the argmax often
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(4.0)
    path = out_dir / spec.name
    model.save_pretrained(str(path))
    return path


def peft_model(model_dir: Path, adapter_dir: Path) -> Any:
    """The base model with the saved adapter, through peft (the reference)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base: Any = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=torch.float32, attn_implementation="sdpa")
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


@torch.inference_mode()
def peft_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_tokens, pad_token_id=2)
    tokens: list[int] = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(1) + 1] if 1 in tokens else tokens  # (the test models' EOS is 1)


@torch.inference_mode()
def peft_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[i] | prompt + completion[:i]) under the adapted model."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(lps[start + i, token]) for i, token in enumerate(completion)]
