"""Runs an engine on a grammar that llguidance 1.9.1 cannot mask (its mask computation never returns) and
prints, as one JSON line, what became of each request. test_structured_output.py runs it in a child process: a
stuck llguidance thread cannot be stopped, and it would spin in the test process for the rest of the session.

Usage: python structured_stall_probe.py {compile|mask} MODEL_DIR
- compile: the grammar hangs at its start state, so in the compile thread (after it, a quick constraint must
  still compile);
- mask: the grammar hangs after the token "y", which a bias makes the model pick: in a step's mask fill.
Each step gets STEP_LIMIT_S seconds; a step that takes longer is a stalled engine, reported as such.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

STEP_LIMIT_S = 10.0
STAGE_LIMIT_S = 10.0
# Lark: a terminal /x+/ followed by the literal "x" (llguidance's lexer loops on it)
HANGS_AT_START = 'start: A "a"\nA: /a+/\n'
HANGS_AFTER_Y = 'start: "x" | "y" a\na: A "a"\nA: /a+/\n'


def main(scenario: str, model_dir: str) -> dict[str, Any]:
    import torch
    from engine_server.engine.config import EngineConfig
    from engine_server.engine.llm_engine import LLMEngine
    from engine_server.engine.types import (
        EngineRequest,
        SamplingParams,
        StructuredOutput,
        StructuredOutputKind,
    )
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=model_dir, device=os.environ.get("ENGINE_TEST_DEVICE", "cpu"),
                                    num_kv_blocks=64, grammar_compile_timeout_s=1.0))
    finish: dict[str, str] = {}
    num_tokens: dict[str, int] = {}
    refused: dict[str, str] = {}
    report: dict[str, Any] = {"finish": finish, "num_tokens": num_tokens, "refused": refused}

    def stalled() -> None:
        print(json.dumps({**report, "stalled": True}), flush=True)
        os._exit(0)

    def run_until(request_ids: set[str]) -> None:
        deadline = time.monotonic() + STAGE_LIMIT_S
        while time.monotonic() < deadline and not request_ids <= set(finish) | set(refused):
            watchdog = threading.Timer(STEP_LIMIT_S, stalled)
            watchdog.start()
            deltas = engine.step()
            watchdog.cancel()
            for d in deltas:
                num_tokens[d.request_id] = num_tokens.get(d.request_id, 0) + len(d.new_token_ids)
                if d.finish_reason is not None:
                    finish[d.request_id] = d.finish_reason.name
            refused.update((request_id, str(error)) for request_id, error in engine.pop_rejected())

    plain = EngineRequest("plain", (11, 12, 13, 14), SamplingParams(temperature=0.0, max_tokens=20))
    if scenario == "compile":
        hang = StructuredOutput(StructuredOutputKind.GRAMMAR, HANGS_AT_START)
        engine.add_request(EngineRequest("hang", (11, 12, 13), SamplingParams(max_tokens=20), hang))
        engine.add_request(plain)
        run_until({"hang", "plain"})
        after = StructuredOutput(StructuredOutputKind.REGEX, "[0-9]{3}")
        engine.add_request(EngineRequest("after", (11, 12), SamplingParams(temperature=0.0, max_tokens=20),
                                         after))
        run_until({"after"})
    else:
        tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        (y,) = tokenizer.encode("y", add_special_tokens=False).ids
        hang = StructuredOutput(StructuredOutputKind.GRAMMAR, HANGS_AFTER_Y)
        engine.add_request(EngineRequest("hang", (11, 12, 13), SamplingParams(
            temperature=0.0, max_tokens=20, logit_bias=((y, 100.0),)), hang))
        engine.add_request(plain)
        run_until({"hang", "plain"})
    return {**report, "stalled": False, "is_idle": not engine.has_unfinished()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
    os._exit(0)  # NOTE: a stuck llguidance thread would keep the interpreter from exiting
