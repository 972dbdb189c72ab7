"""Two CPU ranks, ZeRO-3, a tied head, sequences of other lengths per rank (12 and 7 tiles): tiled steps as untiled, no hang.

Run by tests/unit/families/test_tiled_loss.py (a subprocess: torch.multiprocessing.spawn re-imports this file).
"""

import copy
import os

import torch
import torch.multiprocessing as mp

def worker(rank, port):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    from zeropipe.families.causal_lm import tiled_loss
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, tie_word_embeddings=True)).float()
    g = torch.Generator().manual_seed(10 + rank)
    length = 40 if rank == 0 else 23  # 80 vs 46 tokens: 12 vs 7 tiles of 7
    ids = torch.randint(0, 1000, (2, length), generator=g)
    out = {}
    for tile in (0, 7):
        model = copy.deepcopy(base)
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=ds)
        head = engine.module.get_output_embeddings()
        tiled_loss.mark_tied(engine.module)
        losses = []
        for _ in range(3):
            if tile:
                total, n = tiled_loss.token_loss_sum(engine, head, tile, True, labels=ids, input_ids=ids)
                loss = total / n
            else:
                loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            out[tile] = (losses, {k: p.detach().clone() for k, p in engine.module.named_parameters()})
    (a, wa), (b, wb) = out[0], out[7]
    worst = max(float((wa[k] - wb[k]).norm() / wa[k].norm()) for k in wa)
    print(f"rank {rank}: untiled losses {a}; tiled losses {b}; worst relative weight difference {worst:.2e}", flush=True)
    assert all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a, b)), (a, b)
    assert worst <= 1e-6, worst

if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2)
