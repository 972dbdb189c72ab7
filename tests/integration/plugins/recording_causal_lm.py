"""The causal LM family, recording which examples each optimizer step trains on (a test plug-in).

Registered under the built-in's own name, so configs and checkpoints are those of any causal
LM run. Every rank appends ``{"step": N, "example": INDEX}`` lines to
``$RECORD_EXAMPLES_TO/rank{R}.jsonl`` as its task reads an example: the data order across
a resume is then observed in the real ranks, not recomputed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from zeropipe.families import register
from zeropipe.families.causal_lm import CausalLM
from zeropipe.families.causal_lm.task import CausalLMTask


class RecordedExamples:
    def __init__(self, dataset, trainer, folder: Path):
        self.dataset, self.trainer = dataset, trainer
        folder.mkdir(parents=True, exist_ok=True)
        self.file = folder / f"rank{trainer.rank}.jsonl"

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        # Read while the step is being assembled: trainer.step counts the steps already done.
        with open(self.file, "a") as handle:
            handle.write(json.dumps({"step": self.trainer.step + 1, "example": int(index)}) + "\n")
        return self.dataset[index]


class RecordingTask(CausalLMTask):
    def setup_data(self) -> None:
        super().setup_data()
        self.dataset = RecordedExamples(self.dataset, self.trainer, Path(os.environ["RECORD_EXAMPLES_TO"]))


class RecordingCausalLM(CausalLM):
    def rank_task(self, trainer) -> CausalLMTask:
        return RecordingTask(trainer)


register(RecordingCausalLM(), first=True)
