"""Fill vLLM's cache of model-class facts (``modelinfos``) for the
architectures the suite starts, in one process, at the start of ``make test``.

The first time an engine of an architecture starts, vLLM inspects its model
class in a fresh Python (so that the inspecting process never initialises
CUDA) and caches the answer, checked against a hash of the class's source,
in ``$VLLM_CACHE_ROOT/modelinfos``. Each of those Pythons imports vLLM: about
13 s of CPU, fourteen times in a suite run (one per architecture), about 190
s in all. The suite shares one ``modelinfos`` folder (tests/conftest.py), and
this script fills it for every architecture in one Python, which exists only
to inspect: it asks vLLM's registry for each class with the inspection run
in this process instead of a fresh one each. What it writes is what vLLM's
own inspection writes (the same function, the same hash, the same atomic
write). An engine that looks before its architecture's entry is written
inspects the class itself, as it would without this script.

    python tests/_modelinfos.py [ARCH ...]   (none: SUITE_ARCHS)
"""

from __future__ import annotations

import sys

#: every architecture the suite starts, in the order the suite first needs
#: them (the Mixtral test runs first, the bundled models are Llamas)
SUITE_ARCHS = (
    "MixtralForCausalLM", "LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2ForCausalLM",
    "Gemma2ForCausalLM", "GemmaForCausalLM", "Gemma3ForCausalLM", "MistralForCausalLM",
    "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Phi3ForCausalLM", "GPTJForCausalLM",
    "OPTForCausalLM", "TransformersForCausalLM",
)


def main(archs: list[str]) -> int:
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
    missed = [a for a in archs if registry.ModelRegistry._try_inspect_model_cls(a) is None]
    if missed:
        print(f"vLLM could not inspect {missed}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(SUITE_ARCHS)))
