"""PeFLL (fedrod_ray.personalization.pefll): Adam and the regularised, clipped server step by hand, the
descriptor, the round's backward pass split between the server (through H) and each client (through E)
against the gradient of the whole composition, the two-way exchange within a round, the client's update,
its PM and GM, its config, and the whole method trained, checkpointed and resumed bitwise in process."""

from __future__ import annotations

import math

import pytest
import torch
from hypernets import assert_config_error_names, assert_pms_and_gm, assert_trains_and_resumes_bitwise
from test_federation import _same, make_federation
from test_personalization_updates import CID, ROUND, close, plain_sgd

from fedrod_ray.client_update.local import LocalResult, RoundInput
from fedrod_ray.config.values import ConfigError
from fedrod_ray.personalization import build_method, mean_state
from fedrod_ray.personalization.finetune import fine_tune
from fedrod_ray.personalization.pefll import (
    ADAM_STEP,
    BACKWARD,
    DESCRIBE,
    DESCRIBE_TAG,
    DESCRIPTOR,
    DESCRIPTORS,
    ENET,
    GRAD,
    MODEL,
    SCALE,
    EmbeddingNetwork,
    adam_step,
    descriptor,
    first_scale,
    psi,
    rescaled,
    server_step,
)
from fedrod_ray.personalization.pfedhn import NET, generate, hyper_vjp
from fedrod_ray.personalization.sgd import client_batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PEFLL = ("train.head=pefll", "train.balanced_loss=ce")


def host_ask(host, round_idx: int, log: list):
    """An ``Ask`` answered by ``host``'s clients, recording each question."""

    def ask(phase, common, questions):
        log.append((phase, sorted(questions)))
        return {cid: host.answer(cid, phase, common, q, round_idx) for cid, q in questions.items()}

    return ask


# --- the math, by hand -------------------------------------------------------------------------------------


def test_adam_is_torchs_and_its_first_step_moves_each_weight_by_the_learning_rate():
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = torch.optim.Adam([param], lr=0.01, foreach=False)
    mine, avg, sq = torch.tensor([1.0, -2.0, 0.5]), torch.zeros(3), torch.zeros(3)
    for step, grad in enumerate((torch.tensor([0.3, -0.1, 0.0]), torch.tensor([-0.2, 0.4, 1.0])), 1):
        param.grad = grad.clone()
        opt.step()
        mine, avg, sq = adam_step(mine, grad, avg, sq, step, 0.01)
        assert torch.equal(mine, param.detach()), step
    # The first step: m = 0.1 g, v = 0.001 g^2, bias-corrected m / sqrt(v) = sign(g) (up to eps).
    p, _, _ = adam_step(torch.tensor([1.0]), torch.tensor([0.5]), torch.zeros(1), torch.zeros(1), 1, 0.01)
    assert torch.allclose(p, torch.tensor([0.99]))


def test_the_server_step_adds_the_regularisers_clips_and_steps_phi_and_psi_together():
    params = build_method("pefll", {"reg_hyper": 0.1, "reg_embed": 0.2}).params
    state = {NET + "a": torch.tensor([1.0]), ENET + "b": torch.tensor([-1.0]),
             "adam_avg/" + NET + "a": torch.zeros(1), "adam_sq/" + NET + "a": torch.zeros(1),
             "adam_avg/" + ENET + "b": torch.zeros(1), "adam_sq/" + ENET + "b": torch.zeros(1),
             ADAM_STEP: torch.zeros((), dtype=torch.float64)}
    # g_phi = 0.5 + 0.1 * 1 = 0.6; g_psi = 0.1 + 0.2 * -1 = -0.1: Adam's first step, lr each way.
    new = server_step(state, {NET + "a": torch.tensor([0.5]), ENET + "b": torch.tensor([0.1])}, params)
    lr = params.server_lr
    assert torch.allclose(new[NET + "a"], torch.tensor([1 - lr])) and torch.allclose(new[ENET + "b"], torch.tensor([-1 + lr]))
    assert torch.allclose(new["adam_avg/" + NET + "a"], torch.tensor([0.06]))
    assert torch.allclose(new["adam_avg/" + ENET + "b"], torch.tensor([-0.01]))
    assert new[ADAM_STEP] == 1 and state[ADAM_STEP] == 0  # the state before is not written into
    # Clipping is joint: gradients (300, 400) have norm 500, clipped to 50: (30, 40) enter Adam.
    zero = build_method("pefll", {"reg_hyper": 0.0, "reg_embed": 0.0}).params
    clipped = server_step(state, {NET + "a": torch.tensor([300.0]), ENET + "b": torch.tensor([400.0])}, zero)
    assert torch.allclose(clipped["adam_avg/" + NET + "a"], torch.tensor([3.0]), atol=1e-5)
    assert torch.allclose(clipped["adam_avg/" + ENET + "b"], torch.tensor([4.0]), atol=1e-5)


def test_the_embedding_network_reads_the_labels_as_channels_and_the_descriptor_is_the_batch_mean():
    torch.manual_seed(0)
    enet = EmbeddingNetwork(1, 3, 4)
    psi_ = {ENET + k: p.detach() for k, p in enet.named_parameters()}
    x, y = torch.randn(5, 1, 28, 28), torch.tensor([0, 2, 1, 1, 0])
    assert enet.conv1.in_channels == 4 and enet.fc1.in_features == 512
    each = torch.stack([enet(x[i:i + 1], y[i:i + 1])[0] for i in range(5)])
    assert torch.allclose(descriptor(enet, psi_, x, y), each.mean(0), atol=1e-6)
    assert not torch.allclose(enet(x[:1], torch.tensor([1])), enet(x[:1], torch.tensor([2])))  # labels matter
    assert EmbeddingNetwork(3, 3, 4)(torch.randn(2, 3, 32, 32), torch.tensor([0, 1])).shape == (2, 4)  # any size


def test_a_standardized_descriptor_is_the_batch_mean_less_its_mean_over_its_standard_deviation():
    class Scale(torch.nn.Module):  # E(x, y; w) = w * x: the batch mean is w times x's
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, y):
            return self.w * x

    x, y = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]]), torch.tensor([0, 1])
    psi_ = {ENET + "w": torch.tensor(2.0)}
    assert torch.equal(descriptor(Scale(), psi_, x, y), torch.tensor([4.0, 6.0, 8.0]))
    # (4, 6, 8): mean 6, standard deviation (unbiased) 2.
    assert torch.equal(descriptor(Scale(), psi_, x, y, standardize=True), torch.tensor([-1.0, 0.0, 1.0]))


@pytest.mark.parametrize("scaling", ["standardize", "official"])
def test_rescaling_needs_a_descriptor_of_two_coordinates_or_more(scaling):
    with pytest.raises(ConfigError) as e:
        make_federation(*PEFLL, f"train.head_params={{descriptor_scaling: {scaling}, embed_dim: 1}}")
    assert str(e.value).startswith("train.head_params.descriptor_scaling"), str(e.value)


def test_the_old_standardize_key_is_refused_naming_what_replaced_it():
    with pytest.raises(ConfigError) as e:
        make_federation(*PEFLL, "train.head_params={standardize: true}")
    assert str(e.value).startswith("train.head_params.standardize was replaced by "
                                   "train.head_params.descriptor_scaling"), str(e.value)


@pytest.mark.parametrize("standardize", [False, True])
def test_the_backward_pass_split_between_server_and_client_is_the_gradient_of_the_whole_map(standardize):
    """psi -> v = mean E(x, y; psi) (standardized or not) -> w = H(v; phi): the server's (dw/dphi)^T c and
    (dw/dv)^T c, then the client's answer (dv/dpsi)^T (dw/dv)^T c on the same batch, are
    torch.autograd.functional.vjp of the whole map."""
    scaling = "standardize" if standardize else "none"
    fed = make_federation(*PEFLL, f"train.head_params={{descriptor_scaling: {scaling}}}")
    host, method, state = fed.executor.host, fed.method, fed.method_state
    v = host.answer(CID, DESCRIBE, psi(state), {}, ROUND)[DESCRIPTOR]
    g = torch.Generator().manual_seed(2)
    w = method.model_from(state, v)
    cot = {k: torch.randn(t.shape, generator=g) for k, t in w.items()}
    phi_grads, grad_v = hyper_vjp(method.net, state, v, cot)
    psi_grads = host.answer(CID, BACKWARD, psi(state), {GRAD: grad_v}, ROUND)

    xb, yb = next(client_batches(host.data(CID), host.context_of(CID, ROUND), DESCRIBE_TAG, epochs=1))[0]
    keys = [k for k in state if k.startswith((NET, ENET))]
    enet = method.embedding_network(psi(state), host.data(CID))

    def whole(*tensors):
        s = dict(zip(keys, tensors))
        v = descriptor(enet, {k: t for k, t in s.items() if k.startswith(ENET)}, xb, yb, standardize)
        out = generate(method.net, s, v)
        return tuple(out.values())

    _, expected = torch.autograd.functional.vjp(whole, tuple(state[k] for k in keys), tuple(cot[k] for k in w))
    mine = {**phi_grads, **psi_grads}
    for k, e in zip(keys, expected):
        assert torch.allclose(mine[k], e, rtol=1e-4, atol=1e-6), k
    assert any(psi_grads[k].abs().sum() > 0 for k in psi_grads)


def test_a_round_describes_sends_models_trains_then_runs_the_backward_pass_on_the_clients():
    """The exchange: describe the sampled clients, send each H(v_m); after training, the server sends each
    (dw_m/dv_m)^T c_m back and averages phi's and psi's gradients over the round's clients; then every training
    client is described again, and the global weights are the mean of the PMs."""
    fed = make_federation(*PEFLL, "train.head_params={reg_model: 0.5}")
    host, method, state = fed.executor.host, fed.method, fed.method_state
    asked: list = []
    ids = [3, 1]
    sent = method.messages(state, ids, {}, 0, 0, host_ask(host, 0, asked))
    assert asked == [(DESCRIBE, [1, 3])] and sorted(sent) == [1, 3]
    for cid in ids:
        v = host.answer(cid, DESCRIBE, psi(state), {}, 0)[DESCRIPTOR]
        assert torch.equal(sent[cid][DESCRIPTOR], v)
        assert _same({k[len(MODEL):]: t for k, t in sent[cid].items() if k.startswith(MODEL)},
                     method.model_from(state, v))
    trained = {cid: {k[len(MODEL):]: t * 0.9 for k, t in sent[cid].items() if k.startswith(MODEL)} for cid in ids}
    results = {cid: LocalResult(trained[cid], 5, 0.0, None, 1, 0.0, method_upload={DESCRIPTOR: sent[cid][DESCRIPTOR]})
               for cid in ids}
    asked.clear()
    gm, new = method.server_update(dict(fed.global_shared), results, {}, state, fed.initial, 6, host_ask(host, 0, asked))
    assert asked == [(BACKWARD, [1, 3]), (DESCRIBE, list(range(6)))]
    # By hand: the mean over the two clients of the server's and the clients' gradients, c_m = Delta + 0.5 w_m.
    grads = {}
    for cid in ids:
        v = sent[cid][DESCRIPTOR]
        w = method.model_from(state, v)
        phi_g, gv = hyper_vjp(method.net, state, v, {k: w[k] - trained[cid][k] + 0.5 * w[k] for k in w})
        for k, t in {**phi_g, **host.answer(cid, BACKWARD, psi(state), {GRAD: gv}, 0)}.items():
            grads[k] = grads.get(k, 0) + t / 2
    expected = server_step(state, grads, method.params)
    for k in grads:
        assert torch.allclose(new[k], expected[k], rtol=1e-5, atol=1e-7), k
    table = torch.stack([host.answer(m, DESCRIBE, psi(new), {}, 0)[DESCRIPTOR] for m in range(6)])
    assert torch.equal(new[DESCRIPTORS], table)
    assert _same(gm, mean_state(method.model_from(new, table[m]) for m in range(6)))


def test_the_official_rescaling_is_the_first_descriptors_mean_and_std_fixed_and_differentiated_through():
    """descriptor_scaling: official: the round's lowest described client's raw descriptor gives (m, s), which
    the messages carry and the uploads bring back; H takes (v - m) / s, each client is sent its gradient
    through that map, (dw/dv')^T c / s, and the PMs' descriptors are rescaled by the same (m, s)."""
    fed = make_federation(*PEFLL, "train.head_params={descriptor_scaling: official}")
    host, method, state = fed.executor.host, fed.method, fed.method_state
    assert state[SCALE].isnan().all()
    ids = [3, 1]
    sent = method.messages(state, ids, {}, 0, 0, host_ask(host, 0, []))
    raw = {cid: host.answer(cid, DESCRIBE, psi(state), {}, 0)[DESCRIPTOR] for cid in ids}
    m, s = raw[1].mean(), raw[1].std()
    assert torch.equal(sent[3][SCALE], torch.stack([m, s])) and torch.equal(sent[1][SCALE], sent[3][SCALE])
    v3 = (raw[3] - m) / s
    assert torch.equal(rescaled(raw[3], sent[3][SCALE]), v3) and torch.equal(first_scale(raw[1]), sent[1][SCALE])
    assert _same({k[len(MODEL):]: t for k, t in sent[3].items() if k.startswith(MODEL)}, method.model_from(state, v3))
    trained = {cid: {k[len(MODEL):]: t * 0.9 for k, t in sent[cid].items() if k.startswith(MODEL)} for cid in ids}
    results = {cid: LocalResult(trained[cid], 5, 0.0, None, 1, 0.0,
                                method_upload={DESCRIPTOR: raw[cid], SCALE: sent[cid][SCALE]}) for cid in ids}
    _, new = method.server_update(dict(fed.global_shared), results, {}, state, fed.initial, 6, host_ask(host, 0, []))
    assert torch.equal(new[SCALE], sent[1][SCALE])
    grads = {}
    for cid in ids:
        v = (raw[cid] - m) / s
        w = method.model_from(state, v)
        phi_g, gv = hyper_vjp(method.net, state, v, {k: w[k] - trained[cid][k] for k in w})
        for k, t in {**phi_g, **host.answer(cid, BACKWARD, psi(state), {GRAD: gv / s}, 0)}.items():
            grads[k] = grads.get(k, 0) + t / 2
    expected = server_step(state, grads, method.params)
    for k in grads:
        assert torch.allclose(new[k], expected[k], rtol=1e-5, atol=1e-7), k
    table = torch.stack([(host.answer(c, DESCRIBE, psi(new), {}, 0)[DESCRIPTOR] - m) / s for c in range(6)])
    assert torch.equal(new[DESCRIPTORS], table)
    assert torch.equal(method.new_client_message(new, fed.global_shared)[SCALE], new[SCALE])
    assert SCALE not in method.new_client_message(state, fed.global_shared)  # none taken yet


def test_a_client_that_does_not_answer_the_backward_question_is_left_out_of_psis_mean_not_phis():
    """Two clients trained; client 3 does not answer BACKWARD. phi's gradient is the mean of both clients'
    (dw_m/dphi)^T c_m (the server computes those), psi's the mean over the one answer: client 1's answer
    itself, not half of it (the old code divided psi's sum by the round's two results)."""
    fed = make_federation(*PEFLL, "train.head_params={reg_hyper: 0.0, reg_embed: 0.0}")
    host, method, state = fed.executor.host, fed.method, fed.method_state
    ids = [1, 3]
    sent = method.messages(state, ids, {}, 0, 0, host_ask(host, 0, []))
    trained = {cid: {k[len(MODEL):]: t * 0.9 for k, t in sent[cid].items() if k.startswith(MODEL)} for cid in ids}
    results = {cid: LocalResult(trained[cid], 5, 0.0, None, 1, 0.0, method_upload={DESCRIPTOR: sent[cid][DESCRIPTOR]})
               for cid in ids}
    answered = host_ask(host, 0, [])

    def ask_without_3(phase, common, questions):
        return answered(phase, common, {c: q for c, q in questions.items() if not (phase == BACKWARD and c == 3)})

    _, new = method.server_update(dict(fed.global_shared), results, {}, state, fed.initial, 6, ask_without_3)
    grads, answer_1 = {}, None
    for cid in ids:
        v = sent[cid][DESCRIPTOR]
        w = method.model_from(state, v)
        phi_g, gv = hyper_vjp(method.net, state, v, {k: w[k] - trained[cid][k] for k in w})
        for k, t in phi_g.items():
            grads[k] = grads.get(k, 0) + t / 2
        if cid == 1:
            answer_1 = host.answer(cid, BACKWARD, psi(state), {GRAD: gv}, 0)
    expected = server_step(state, {**grads, **answer_1}, method.params)
    # Adam's first step is lr * sign(g) per weight: compare the moments, which carry g's scale (m_1 = 0.1 g).
    for k in grads.keys() | answer_1.keys():
        assert torch.allclose(new["adam_avg/" + k], expected["adam_avg/" + k], rtol=1e-5, atol=1e-9), k


def test_a_client_that_cannot_describe_itself_gets_no_model_and_its_update_says_why():
    fed = make_federation(*PEFLL)
    host = fed.executor.host
    sent = fed.method.messages(fed.method_state, [1, 2], {}, 0, 0, lambda phase, common, qs: {})
    assert sent == {}
    out = host.train(1, fed.clients[1], RoundInput(fed.global_shared, per_client=sent), 0)
    assert "descriptor did not reach the server" in out.error


def test_a_client_that_does_not_answer_keeps_its_last_descriptor_and_the_others_step_without_it():
    fed = make_federation(*PEFLL)
    fed.step(0)
    host, method, state = fed.executor.host, fed.method, fed.method_state
    answered = host_ask(host, 1, [])

    def ask_without_2(phase, common, questions):
        return answered(phase, common, {c: q for c, q in questions.items() if c != 2})

    state_1 = server_step(state, {k: torch.zeros_like(v) for k, v in state.items() if k.startswith((NET, ENET))},
                          method.params)  # a new psi: every answer changes
    gm, new = method.refresh(state_1, 6, ask_without_2)
    assert torch.equal(new[DESCRIPTORS][2], state[DESCRIPTORS][2])
    assert all(not torch.equal(new[DESCRIPTORS][m], state[DESCRIPTORS][m]) for m in (0, 1, 3, 4, 5))
    assert _same(gm, mean_state(method.model_from(new, new[DESCRIPTORS][m]) for m in range(6)))


# --- the client, the PM, the GM, the config ---------------------------------------------------------------------


def test_the_client_trains_from_the_model_made_from_its_descriptor_and_returns_the_descriptor():
    fed = make_federation(*PEFLL)
    host = fed.executor.host
    sent = fed.method.messages(fed.method_state, [CID], {}, ROUND, fed.cfg.seed, host_ask(host, ROUND, []))
    res, personal, _ = host.method.train(host.model, RoundInput(fed.global_shared, per_client=sent), host.data(CID),
                                         None, None, {}, {}, {}, host.context_of(CID, ROUND))
    start = {k[len(MODEL):]: t for k, t in sent[CID].items() if k.startswith(MODEL)}
    expected = plain_sgd(host, start, client_batches(host.data(CID), host.context_of(CID, ROUND)))
    assert personal is None and close(res.shared, expected)
    assert torch.equal(res.method_upload[DESCRIPTOR], sent[CID][DESCRIPTOR])


def test_the_pm_is_the_hypernetworks_model_of_the_clients_descriptor_and_the_gm_their_mean():
    fed = make_federation(*PEFLL)
    fed.step(0)
    table = fed.method_state[DESCRIPTORS]
    assert table.abs().sum(1).gt(0).all()  # every training client was described, sampled or not
    assert_pms_and_gm(fed, [fed.method.model_from(fed.method_state, table[c]) for c in range(fed.setup.num_clients)])


@pytest.mark.parametrize("extra, field", [
    (("train.head=pefll",), "train.balanced_loss"),
    ((*PEFLL, "model.arch=resnet20"), "model.arch"),
    ((*PEFLL, "train.head_params={server_lr: 0}"), "train.head_params.server_lr"),
    ((*PEFLL, "train.head_params={reg_model: -1}"), "train.head_params.reg_model"),
    ((*PEFLL, "privacy.enabled=true", "privacy.noise_multiplier=1"), "train.head"),
    ((*PEFLL, "rounds.mode=fedbuff"), "train.head"),
    ((*PEFLL, "eval.finetune_epochs=1", "eval.finetune_train=true"), "eval.finetune_train"),
])
def test_a_pefll_setting_that_makes_no_sense_names_the_field(extra, field):
    assert_config_error_names(extra, field)


# --- end to end --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pefll_trains_and_resumes_bitwise_from_its_checkpoint(tmp_path):
    """The checkpoint holds the whole server: the hypernetwork, the embedding network, Adam's moments and step
    and every client's descriptor; a federation restored from it trains on to the uninterrupted one's bits."""
    assert_trains_and_resumes_bitwise(PEFLL, tmp_path, {"hnet", "enet", "adam_avg", "adam_sq", ADAM_STEP,
                                                        DESCRIPTORS})


# --- a client that never trained --------------------------------------------------------------------------------


def test_a_new_clients_zero_shot_model_is_e_over_its_training_set_then_h_and_after_it_is_fine_tuned():
    """Zero-shot: the model the server would make from the client's descriptor over its whole training set
    (then H), made on the client from both networks; after: that model fine-tuned on its data."""
    fed = make_federation(*PEFLL, "train.batch_size=3")  # several batches per client
    fed.step(0)
    host, cid = fed.executor.host, fed.setup.num_clients  # a held-out client
    method, state = fed.method, fed.method_state
    assert method.new_client_needs == "data" and not method.zero_shot_is_reading
    received = method.new_client_message(state, fed.global_shared)
    assert set(received) == {k for k in state if k.startswith((NET, ENET))}
    message = RoundInput(fed.global_shared, per_client={cid: received})
    ctx = host.context_of(cid, 1)
    zero_shot = {k: v.clone() for k, v in host.method.new_client_model(host.model, message, host.data(cid),
                                                                      ctx).state_dict().items()}
    # E over the client's whole training set (the official code's evaluation), not the round's one batch.
    batches = next(client_batches(host.data(cid), ctx, DESCRIBE_TAG, epochs=1))
    assert len(batches) > 1
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    enet = method.embedding_network(psi(state), host.data(cid))
    v = descriptor(enet, psi(state), x, y)
    each = sum(descriptor(enet, psi(state), xb, yb) * len(yb) for xb, yb in batches) / len(host.data(cid))
    assert torch.allclose(v, each, atol=1e-6)  # the mean over every example, whatever the batches
    assert _same(zero_shot, method.model_from(state, v))
    one_batch = host.answer(cid, DESCRIBE, psi(state), {}, 1)[DESCRIPTOR]
    assert not _same(zero_shot, method.model_from(state, one_batch))
    tuned = host.method.adapt(host.model, message, host.data(cid), None, 1, ctx)
    assert "pefll adapts only" in str(pytest.raises(ValueError, host.method.adapt, host.model,
                                                    RoundInput(fed.global_shared), host.data(1), None, 1,
                                                    host.context_of(1, 1)).value)
    reference = make_federation(*PEFLL, "train.batch_size=3").executor.host
    fine_tune(reference.model, zero_shot, host.data(cid), None, 1, ctx)
    assert _same(tuned.state_dict(), reference.model.state_dict())


def test_pefll_scores_new_clients_before_and_after_in_the_evaluation():
    fed = make_federation(*PEFLL, "eval.finetune_epochs=1")
    record = [fed.step(r) for r in range(2)][-1]
    assert math.isfinite(record["pfl_new_before"]) and math.isfinite(record["pfl_new_after"])
    assert record["finetune_failed"] == 0 and record["pm_eval_failed"] == 0


def test_a_question_pefll_does_not_ask_is_an_error_naming_the_phase():
    host = make_federation(*PEFLL).executor.host
    out = host.answer(1, "gossip", {}, {}, 0)
    assert "NotImplementedError" in out.error and "'gossip'" in out.error
