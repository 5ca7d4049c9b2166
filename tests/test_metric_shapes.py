"""Metrics read widths from tensors, never from config fields: OPT with a projected
hidden size (``word_embed_proj_dim`` narrower or wider than ``hidden_size``), and a
sample with a single valid token. Each result is checked against an independent
reference written without the metric's code (``torch.autograd.functional.jacobian``,
numpy linear CKA), on tiny float64 models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oomguard.metrics.base import get_metric
from oomguard.metrics.models import build_model, make_batch

OPT = ("opt:hidden_size=16,word_embed_proj_dim={proj},num_hidden_layers=2,ffn_dim=32,"
       "num_attention_heads=2,vocab_size=64,max_position_embeddings=32")


def _model(proj: int) -> torch.nn.Module:
    return build_model(OPT.format(proj=proj), dtype="float64", seed=3)


def _jacobian_reference(model: torch.nn.Module, ids: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """Per-position Frobenius norms of d h_last / d e_p, one sample at a time."""
    rows = []
    for i in range(ids.shape[0]):
        last = int(mask[i].nonzero().max())
        emb = model.get_input_embeddings()(ids[i:i + 1]).detach()

        def h(e: torch.Tensor, i: int = i, last: int = last) -> torch.Tensor:
            out = model.base_model(inputs_embeds=e, attention_mask=mask[i:i + 1])
            return out.last_hidden_state[0, last]

        jac = torch.autograd.functional.jacobian(h, emb)  # [d_out, 1, seq, d_in]
        rows.append(jac.square().sum(dim=(0, 1, 3)).sqrt() * mask[i])
    return torch.stack(rows)


def _cka_reference(model: torch.nn.Module, data: dict) -> np.ndarray:
    with torch.no_grad():
        out = model.base_model(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                               output_hidden_states=True)
    keep = data["attention_mask"].bool()
    feats = [h[keep].double().numpy() for h in out.hidden_states]
    centred = [x - x.mean(axis=0) for x in feats]

    def hsic(x: np.ndarray, y: np.ndarray) -> float:
        return float(np.linalg.norm(x.T @ y, "fro") ** 2)

    return np.array([[hsic(x, y) / np.sqrt(hsic(x, x) * hsic(y, y)) for y in centred]
                     for x in centred])


@pytest.mark.slow
@pytest.mark.parametrize("proj", [8, 24], ids=["narrower", "wider"])
def test_position_jacobian_uses_the_width_of_the_hidden_state(proj: int) -> None:
    model = _model(proj)
    data = make_batch(3, 10, 64, seed=1)
    result = get_metric("position_jacobian").run(model, data, micro_batch_size=2, vjp_block=5)
    reference = _jacobian_reference(model, data["input_ids"], data["attention_mask"])
    torch.testing.assert_close(result["norms"], reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("proj", [8, 24], ids=["narrower", "wider"])
def test_cka_handles_layers_of_different_widths(proj: int) -> None:
    model = _model(proj)
    data = make_batch(4, 10, 64, seed=2)
    result = get_metric("cka").run(model, data, chunk_size=3)
    widths = {h.shape[-1] for h in model.base_model(
        input_ids=data["input_ids"][:1], output_hidden_states=True).hidden_states}
    assert widths == {16, proj}  # the layers really differ
    np.testing.assert_allclose(result["cka"].numpy(), _cka_reference(model, data), rtol=1e-9)


@pytest.mark.slow
def test_position_jacobian_of_a_sample_with_one_valid_token() -> None:
    model = build_model("tiny-gpt2", dtype="float64")
    data = make_batch(2, 6, 256, seed=4)
    data["attention_mask"][0, 1:] = 0  # sample 0: one valid token
    data["input_ids"][0, 1:] = 0
    result = get_metric("position_jacobian").run(model, data, micro_batch_size=2, vjp_block=7)
    reference = _jacobian_reference(model, data["input_ids"], data["attention_mask"])
    torch.testing.assert_close(result["norms"], reference, rtol=1e-10, atol=1e-12)
    assert result["norms"][0, 0] > 0 and bool((result["norms"][0, 1:] == 0).all())


TUPLE_BLOCKS = {
    "gptj": "gptj:n_embd=32,n_layer=2,n_head=2,vocab_size=64,n_positions=32,rotary_dim=8,"
            "bos_token_id=0,eos_token_id=0",
    "falcon": "falcon:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,vocab_size=64",
    "bloom": "bloom:hidden_size=32,n_layer=2,n_head=2,vocab_size=64",
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TUPLE_BLOCKS))
def test_layer_attribution_on_blocks_that_return_tuples(family: str) -> None:
    model = build_model(TUPLE_BLOCKS[family], dtype="float64", seed=5)
    data = make_batch(3, 8, 64, seed=6)
    metric = get_metric("layer_attribution")
    big = metric.run(model, data, n_steps=8, chunk_size=3, internal_batch_size=24)
    small = metric.run(model, data, n_steps=8, chunk_size=1, internal_batch_size=1)
    assert big["n_layers"] == 2
    torch.testing.assert_close(big["scores"], small["scores"], rtol=1e-9, atol=1e-12)
    assert big["delta_max"] < 1e-2  # completeness holds: every block's output was attributed


@pytest.mark.slow
def test_layer_attribution_matches_captum_called_directly() -> None:
    from captum.attr import LayerIntegratedGradients

    from oomguard.metrics.integrated_gradients import pad_id, target_args, target_forward
    from oomguard.metrics.layer_attribution import transformer_blocks

    model = build_model("tiny-gpt2", dtype="float64")
    data = make_batch(2, 8, 256, seed=7)
    result = get_metric("layer_attribution").run(model, data, n_steps=8, chunk_size=2)
    args, ids = target_args(data), data["input_ids"]
    for i, block in enumerate(transformer_blocks(model)):
        attr = LayerIntegratedGradients(target_forward(model), block).attribute(
            ids, baselines=torch.full_like(ids, pad_id(model)), additional_forward_args=args,
            n_steps=8, method="gausslegendre")
        attr = attr[0] if isinstance(attr, tuple) else attr
        mass = (attr.double() * args[0].double().unsqueeze(-1)).abs().sum(dim=(1, 2))
        torch.testing.assert_close(result["scores"][:, i], mass, rtol=1e-9, atol=1e-12)


def _fisher_reference(model: torch.nn.Module, data: dict) -> float:
    """Total trace of the empirical Fisher by a plain per-sample loop over samples with
    scored tokens: mean over them of the squared gradient of the sample's mean loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    total, counted = 0.0, 0
    for i in range(data["input_ids"].shape[0]):
        labels = data["labels"][i:i + 1]
        if int((labels[:, 1:] != -100).sum()) == 0:
            continue
        out = model(input_ids=data["input_ids"][i:i + 1],
                    attention_mask=data["attention_mask"][i:i + 1])
        logits = out.logits[:, :-1].double()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        total += sum(float(g.double().square().sum()) for g in grads if g is not None)
        counted += 1
    return total / counted


@pytest.mark.slow
def test_fisher_falls_back_to_an_exact_loop_where_torch_func_cannot_run() -> None:
    # Bloom's GeLU is a torch.autograd.Function without setup_context: vmap refuses it.
    model = build_model(TUPLE_BLOCKS["bloom"], dtype="float64", seed=8)
    data = make_batch(3, 8, 64, seed=9)
    result = get_metric("fisher_diagonal").run(model, data, micro_batch_size=2)
    assert result["method"].startswith("per-sample backward loop")
    assert result["total_trace"] == pytest.approx(_fisher_reference(model, data), rel=1e-9)


@pytest.mark.slow
def test_fisher_ignores_an_all_padding_sample_however_batched() -> None:
    model = build_model("tiny-llama", dtype="float64", seed=10)
    data = make_batch(4, 8, 256, seed=11)
    data["attention_mask"][1] = 0
    data["labels"][1] = -100
    values = {mbs: get_metric("fisher_diagonal").run(model, data, micro_batch_size=mbs)
              for mbs in (1, 2, 4)}
    reference = _fisher_reference(model, data)
    for result in values.values():
        assert result["method"] == "torch.func vmap(grad)" and result["n_samples_scored"] == 3
        assert result["total_trace"] == pytest.approx(reference, rel=1e-9)
