"""The HTTP API through FastAPI's TestClient: every endpoint, its numbers checked against the model computed
directly, and every kind of bad input (a 4xx naming the field, nothing changed)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from fedrod_ray_api import schemas
from fedrod_ray_api.app import create_app
from fedrod_ray_api.schemas import EXAMPLE_PNG
from fedrod_ray_api.settings import Settings
from PIL import Image
from served import CLIENT_IDS, MEAN, SHAPE, STD, bearer, client_tokens, edit_meta, make_final

from fedrod_ray.models.export import ExportError, _version_id, load_final, save_final
from fedrod_ray.outputs.storage import RunStorage

REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for head in ("hyper", "linear", "none"):
        make_final(root / head, head)
    return root


@pytest.fixture
def hyper(runs, tmp_path):
    """A hyper run of this test's own (reload tests change it) and a client with a small cache and batch."""
    shutil.copytree(runs / "hyper", tmp_path / "run")
    settings = Settings(model_dir=str(tmp_path / "run"), max_batch=4, head_cache_size=2, max_body_bytes=2**16)
    app = create_app(settings, admin_token=TOKEN)
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def tokens(runs):
    """The training clients' own tokens, given to the linear server as --client-tokens is."""
    return client_tokens(runs / "tokens.json")


@pytest.fixture(scope="module")
def linear(runs, tokens):
    settings = Settings(model_dir=str(runs / "linear"), client_tokens=str(runs / "tokens.json"))
    with TestClient(create_app(settings, admin_token=TOKEN)) as client:
        yield client


@pytest.fixture(scope="module")
def plain(runs):
    with TestClient(create_app(str(runs / "none"))) as client:
        yield client


def _pixels(n=3, seed=0):
    return torch.randint(0, 256, (n, *SHAPE), generator=torch.Generator().manual_seed(seed)).to(torch.uint8)


def _normalised(x):
    """By hand: (pixel / 255 - mean) / std, channels_last as the model takes it."""
    out = (x.float() / 255 - MEAN[0]) / STD[0]
    return out.contiguous(memory_format=torch.channels_last)


def _png(img, mode="L"):
    buf = io.BytesIO()
    Image.fromarray(img.numpy(), mode=mode).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _served(client):
    return client.app.state.service.current


def _logits(served, x):
    with torch.no_grad():
        z = served.model.features(_normalised(x))
        return z, served.model.generic_head(z)


def _offline_head_id(version, a):
    """What anyone could compute without the server's secret: the unkeyed sha256 of the version and a (the
    id before issue 60)."""
    return hashlib.sha256(version.encode() + b":" + a.numpy().astype("<f4").tobytes()).hexdigest()[:32]


def _top(probs, k):
    values, indices = probs.topk(k)
    return [[{"index": i, "label": str(i), "probability": pytest.approx(p, abs=1e-6)}
             for i, p in zip(ii, vv)] for ii, vv in zip(indices.tolist(), values.tolist())]


# --- health and model info ------------------------------------------------------------------------------


def test_health_and_model(hyper, linear, runs, tmp_path):
    assert hyper.get("/healthz").json() == {"status": "ok"}
    version = load_final(str(tmp_path / "run")).version_id
    assert hyper.get("/readyz").json() == {"status": "ready", "model_version": version}
    info = hyper.get("/v1/model").json()
    assert info == {
        "version_id": version, "dataset": "mnist", "class_names": [str(i) for i in range(10)],
        "num_classes": 10,
        "input": {"shape": SHAPE, "mean": MEAN, "std": STD, "png_mode": "L"}, "head": "hyper",
        "method": "hyper", "generic_model": "global", "new_client": "class_counts",
        "arch": "mnist_cnn", "hyper_hidden": 16, "rule": "fedavg", "balanced_loss": "bsm", "round": 5,
        "metrics": {"gfl_gm": 0.5, "pfl_pm": 0.75}, "client_ids": None, "trained_client_ids": None,
        "privacy": None,
        "limits": {"max_batch": 4, "max_body_bytes": 2**16, "body_timeout_s": 30.0, "head_cache_size": 2},
    }
    assert hyper.get("/v1/model", headers=ADMIN).json() == {**info, "client_ids": [], "trained_client_ids": []}
    info = linear.get("/v1/model", headers=ADMIN).json()
    assert info["head"] == "linear" and info["client_ids"] == info["trained_client_ids"] == list(CLIENT_IDS)
    assert info["hyper_hidden"] is None and info["new_client"] == "none"
    assert info["version_id"] == load_final(str(runs / "linear")).version_id


def test_openapi_lists_every_endpoint_with_examples(hyper):
    schema = hyper.get("/openapi.json").json()
    assert {(m, p) for p, ops in schema["paths"].items() for m in ops} == {
        ("get", "/healthz"), ("head", "/healthz"), ("get", "/readyz"), ("head", "/readyz"), ("get", "/v1/model"), ("post", "/v1/heads"),
        ("get", "/v1/heads/{head_id}"), ("post", "/v1/predict"), ("post", "/v1/admin/reload")}
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(ids)  # GET and HEAD /healthz shared one
    parts = schema["components"]["schemas"]
    # Every request and response body of every operation has examples, and they are valid.
    bodies = {ref.rsplit("/", 1)[1] for ops in schema["paths"].values() for op in ops.values()
              for part in [op.get("requestBody", {}), *op["responses"].values()]
              for ref in re.findall(r'"\$ref": "([^"]+)"', json.dumps(part))}
    assert bodies == {"Health", "Ready", "ModelInfo", "HeadRequest", "HeadResponse", "PredictRequest",
                      "PredictResponse", "ReloadRequest", "ReloadResponse", "ErrorBody"}
    for name in bodies:
        assert parts[name]["examples"], name
        for example in parts[name]["examples"]:
            getattr(schemas, name).model_validate(example)
    # The documented examples work against an MNIST model.
    for example in parts["PredictRequest"]["examples"]:
        assert hyper.post("/v1/predict", json=example).status_code == 200
    for example in parts["HeadRequest"]["examples"]:
        assert hyper.post("/v1/heads", json=example).status_code == 200
    # The rules across fields, and the served model's sizes, are in the schema.
    assert [o["required"] for o in parts["HeadRequest"]["oneOf"]] == [["class_distribution"], ["class_counts"]]
    sources, personal = parts["PredictRequest"]["allOf"]
    assert [o["required"] for o in sources["oneOf"]] == [["images"], ["images", "pixels"], ["images_png"]]
    assert len(personal["oneOf"]) == 5  # one of the four heads, or none
    image = parts["PredictRequest"]["properties"]["images"]["anyOf"][0]
    assert image["maxItems"] == 4 and image["items"]["maxItems"] == 1
    assert parts["HeadRequest"]["properties"]["class_counts"]["anyOf"][0]["maxItems"] == 10
    errors = schema["paths"]["/v1/predict"]["post"]["responses"]
    assert {"404", "409", "413", "422"} <= set(errors)
    assert errors["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


# --- heads ----------------------------------------------------------------------------------------------


def test_zero_shot_head_by_hand(hyper):
    served = _served(hyper).served
    counts = [120, 0, 3, 0, 0, 45, 0, 310, 0, 2]
    r = hyper.post("/v1/heads", json={"class_counts": counts})
    assert r.status_code == 200
    body = r.json()
    a = torch.tensor(counts, dtype=torch.float32) / sum(counts)  # as training computes a client's a
    assert body["class_distribution"] == a.tolist()
    assert body["shape"] == [10, 50] and body["model_version"] == served.version_id
    # H(a) = W2 relu(W1 a), reshaped to (classes, feature_dim).
    w1, w2 = served.model.hypernet.net[0].weight, served.model.hypernet.net[2].weight
    assert torch.allclose(torch.tensor(body["weights"]), (w2 @ torch.relu(w1 @ a)).view(10, 50), atol=1e-6)
    assert body["head_id"] != _offline_head_id(served.version_id, a)

    # The same distribution, given as weights or at another scale, is the same head.
    for same in ({"class_distribution": a.tolist()}, {"class_distribution": [c / 4.8 for c in counts]},
                 {"class_counts": [c * 3 for c in counts]}):
        assert hyper.post("/v1/heads", json=same).json()["head_id"] == body["head_id"], same
    assert hyper.get(f"/v1/heads/{body['head_id']}").json() == body
    other = hyper.post("/v1/heads", json={"class_counts": [1] * 10}).json()
    assert other["head_id"] != body["head_id"]


def test_head_ids_cannot_be_computed_offline(hyper, runs):
    """The attacker's side of the head cache (issue 60): someone posted a distribution; an attacker who
    guesses it computes its id offline, as the unkeyed sha256 made it, and asks GET /v1/heads/{id}. The
    answer is the same 404 as for an id never made, so it confirms nothing; the id the poster got is not
    the offline one; and another server process (a restart, another Ray Serve replica) keys its ids with a
    secret of its own, so even a leaked id says nothing about the distribution there."""
    version = _served(hyper).served.version_id
    secret_counts = [120, 0, 3, 0, 0, 45, 0, 310, 0, 2]
    posted = hyper.post("/v1/heads", json={"class_counts": secret_counts}).json()
    a = torch.tensor(secret_counts, dtype=torch.float32) / sum(secret_counts)
    guessed = _offline_head_id(version, a)
    assert guessed != posted["head_id"]
    probe = hyper.get(f"/v1/heads/{guessed}")
    never = hyper.get("/v1/heads/" + "0" * 32)
    assert probe.status_code == never.status_code == 404
    assert probe.json()["detail"].replace(guessed, "ID") == never.json()["detail"].replace("0" * 32, "ID")
    # Nor is it any key the attacker could guess: another server of the same model gives another id.
    with TestClient(create_app(str(runs / "hyper"))) as other:
        elsewhere = other.post("/v1/heads", json={"class_counts": secret_counts}).json()
        assert elsewhere["weights"] == posted["weights"] and elsewhere["head_id"] != posted["head_id"]
        assert other.get(f"/v1/heads/{posted['head_id']}").status_code == 404


def test_minus_zero_is_the_same_distribution_as_zero(hyper):
    """-0.0 weighs what 0.0 does: the same head_id as 0.0 and as counts, and 0.0 echoed."""
    minus = hyper.post("/v1/heads", json={"class_distribution": [0.5, -0.0, 0.25, 0.25] + [-0.0] * 6})
    plus = hyper.post("/v1/heads", json={"class_distribution": [0.5, 0.0, 0.25, 0.25] + [0.0] * 6})
    counts = hyper.post("/v1/heads", json={"class_counts": [2, 0, 1, 1] + [0] * 6})
    assert minus.json()["head_id"] == plus.json()["head_id"] == counts.json()["head_id"]
    assert minus.json() == plus.json()
    assert all(math.copysign(1, x) == 1 for x in minus.json()["class_distribution"])
    predict = hyper.post("/v1/predict", json={"images": [IMG], "class_distribution": [1.0] + [-0.0] * 9})
    assert predict.json()["personalized"]["head_id"] == hyper.post(
        "/v1/heads", json={"class_counts": [5] + [0] * 9}).json()["head_id"]


def test_head_cache_is_bounded(hyper):
    ids = [hyper.post("/v1/heads", json={"class_counts": [i + 1] + [1] * 9}).json()["head_id"]
           for i in range(3)]
    assert len(set(ids)) == 3
    first = hyper.get(f"/v1/heads/{ids[0]}")
    assert first.status_code == 404 and first.json()["field"] == "head_id"
    assert "evicted" in first.json()["detail"]
    assert [hyper.get(f"/v1/heads/{i}").status_code for i in ids[1:]] == [200, 200]
    assert len(_served(hyper).heads) == 2


@pytest.mark.parametrize("which", ["linear", "plain"])
def test_heads_need_a_hypernetwork(which, request):
    client = request.getfixturevalue(which)
    head = "linear" if which == "linear" else "none"
    r = client.post("/v1/heads", json={"class_counts": [1] * 10})
    assert r.status_code == 409
    assert r.json()["field"] == "class_counts" and f"head '{head}'" in r.json()["detail"]
    assert "hypernetwork" in r.json()["detail"]
    assert client.get("/v1/heads/" + "0" * 32).status_code == 409


@pytest.mark.parametrize("needs", ["data", "training"])
def test_a_method_that_personalizes_new_clients_from_their_data_says_so_instead_of_a_head(needs, runs, tmp_path):
    """A final/ whose method makes a new client's model from the client's own examples (PeFLL: forward passes;
    or training steps): the service cannot make it from a class distribution, and says what it needs."""
    shutil.copytree(runs / "none", tmp_path / "run")
    edit_meta(tmp_path / "run", method="pefll", new_client=needs)
    with TestClient(create_app(str(tmp_path / "run"))) as client:
        assert client.get("/v1/model").json()["new_client"] == needs
        for path, body in (("/v1/heads", {"class_counts": [1] * 10}),
                           ("/v1/heads", {"class_distribution": [0.1] * 10})):
            r = client.post(path, json=body)
            assert r.status_code == 409, r.text
            assert r.json()["field"] == next(iter(body))
            assert "method 'pefll'" in r.json()["detail"] and "from its data" in r.json()["detail"]
            assert "no client data" in r.json()["detail"]


def test_a_final_without_new_client_reads_the_heads_and_a_bad_one_is_refused(runs, tmp_path):
    for head, expected in (("hyper", "class_counts"), ("linear", "none"), ("none", "none")):
        shutil.copytree(runs / head, tmp_path / head)
        path = tmp_path / head / "final" / "meta.json"
        doc = json.loads(path.read_text())
        del doc["new_client"]  # a final/ written before the field
        doc["version_id"] = _version_id(doc)
        path.write_text(json.dumps(doc))
        assert load_final(str(tmp_path / head)).meta.new_client == expected
    edit_meta(tmp_path / "none", new_client="everything")
    with pytest.raises(ExportError, match="new_client must be one of"):
        load_final(str(tmp_path / "none"))


# --- predict --------------------------------------------------------------------------------------------


def test_generic_predictions_by_hand(hyper):
    served = _served(hyper).served
    x = _pixels()
    _, logits = _logits(served, x)
    probs = logits.softmax(1)
    r = hyper.post("/v1/predict", json={"images": x.tolist(), "top_k": 4})
    assert r.status_code == 200
    body = r.json()
    assert body["model_version"] == served.version_id and body["personalized"] is None
    assert torch.allclose(torch.tensor(body["generic"]["probabilities"]), probs, atol=1e-6)
    assert body["generic"]["top_k"] == _top(probs, 4)

    # The same images already normalised, and as PNGs, give the same answer.
    normalised = hyper.post("/v1/predict", json={"images": _normalised(x).tolist(), "pixels": "normalized"})
    pngs = hyper.post("/v1/predict", json={"images_png": [_png(img[0]) for img in x]})
    for other in (normalised, pngs):
        assert other.status_code == 200
        assert torch.allclose(torch.tensor(other.json()["generic"]["probabilities"]), probs, atol=1e-5)
        assert len(other.json()["generic"]["top_k"][0]) == 3  # the default top_k


def test_requests_batched_into_one_forward_get_each_its_own_answer(runs):
    """Ray Serve's batch: requests of different sizes, heads and model versions in one call, each answered
    as the model computes it alone."""
    from fedrod_ray_api.service import batched_probabilities, load

    hyper, linear = load(str(runs / "hyper"), 4), load(str(runs / "linear"), 4)
    with torch.no_grad():  # the fixtures' runs share their generic model: make the versions differ
        linear.served.model.generic_head.weight.mul_(-1)
    heads = torch.randn(2, 10, hyper.served.model.generic_head.in_features,
                        generator=torch.Generator().manual_seed(5))
    batch = [(hyper, _normalised(_pixels(1, seed=2)), None), (linear, _normalised(_pixels(2, seed=3)), heads[0]),
             (hyper, _normalised(_pixels(3, seed=4)), heads[1]), (hyper, _normalised(_pixels(2, seed=6)), None)]
    answers = batched_probabilities(batch)
    assert [len(a) for a in answers] == [1, 2, 2, 1]
    for (loaded, x, head), got in zip(batch, answers):
        with torch.no_grad():
            z = loaded.served.model.features(x)
            generic = loaded.served.model.generic_head(z)
        assert torch.allclose(got[0], generic.softmax(1), atol=1e-6)
        if head is not None:
            assert torch.allclose(got[1], (generic + z @ head.T).softmax(1), atol=1e-6)
    # Each request went through its own model version: the linear model's weights differ.
    assert not torch.allclose(answers[1][0], batched_probabilities([(hyper, batch[1][1], None)])[0][0], atol=1e-3)


def test_an_app_with_a_batching_forward_answers_as_the_plain_app(runs, monkeypatch):
    """create_app(forward=...), as Ray Serve's replica builds it: a small request is decoded on the event
    loop, a larger one on the inference thread; both answer as the plain app does, and a bad one of either
    size gets its 422 naming the field before any forward."""
    import threading

    from fedrod_ray_api import images
    from fedrod_ray_api.routes.predict import INLINE_PIXELS
    from fedrod_ray_api.service import batched_probabilities

    calls, decoded_on = [], []
    decode = images.decode
    monkeypatch.setattr(images, "decode", lambda *a: decoded_on.append(threading.current_thread().name)
                        or decode(*a))

    async def forward(request):
        calls.append(len(request[1]))
        (answer,) = batched_probabilities([request])
        return answer

    small, large = 2, INLINE_PIXELS // (SHAPE[1] * SHAPE[2]) + 1  # at most and above INLINE_PIXELS
    run = str(runs / "hyper")
    with TestClient(create_app(run, forward=forward)) as batching, TestClient(create_app(run)) as plain:
        for n in (small, large):
            body = {"images": _pixels(n, seed=n).tolist(), "class_counts": [3, 0, 0, 1, 0, 0, 0, 0, 0, 2]}
            got, want = batching.post("/v1/predict", json=body), plain.post("/v1/predict", json=body)
            assert got.status_code == want.status_code == 200
            got, want = got.json(), want.json()
            # Each app keys its head ids with a secret of its own.
            assert got["personalized"].pop("head_id") != want["personalized"].pop("head_id")
            assert got == want
            bad = {**body, "images": [*body["images"][:-1], [[[300] * SHAPE[2]] * SHAPE[1]]]}
            r = batching.post("/v1/predict", json=bad)
            assert r.status_code == 422 and r.json()["field"] == f"images[{n - 1}][0][0][0]"
    assert calls == [small, large]
    # The plain app decodes every request on the inference thread, the batching one only the large ones:
    inference = [name.startswith("fedrod-inference") for name in decoded_on]
    assert inference == [False, True, False, True, True, True]  # small: batching, plain, bad; then large


def test_personalized_predictions_by_hand(hyper):
    served = _served(hyper).served
    x = _pixels(2, seed=1)
    counts = [0, 0, 50, 50, 0, 0, 0, 0, 0, 100]
    a = torch.tensor(counts, dtype=torch.float32) / 200
    z, generic = _logits(served, x)
    with torch.no_grad():
        expected = served.model.personal_logits(z, generic, a).softmax(1)  # h_G(z) + H(a; nu) z
    assert not torch.allclose(expected, generic.softmax(1), atol=1e-3)  # the head does something

    r = hyper.post("/v1/predict", json={"images": x.tolist(), "class_counts": counts})
    assert r.status_code == 200
    personal = r.json()["personalized"]
    assert torch.allclose(torch.tensor(personal["probabilities"]), expected, atol=1e-6)
    assert personal["top_k"] == _top(expected, 3)
    assert personal["by"] == "class_counts" and personal["client_id"] is None
    assert personal["head_id"] == hyper.post("/v1/heads", json={"class_counts": counts}).json()["head_id"]
    assert torch.allclose(torch.tensor(r.json()["generic"]["probabilities"]), generic.softmax(1), atol=1e-6)

    for other, by in (({"class_distribution": [c / 200 for c in counts]}, "class_distribution"),
                      ({"head_id": personal["head_id"]}, "head_id")):
        again = hyper.post("/v1/predict", json={"images": x.tolist(), **other}).json()["personalized"]
        assert again["by"] == by and again["head_id"] == personal["head_id"]
        assert again["probabilities"] == personal["probabilities"]


def test_linear_client_heads_by_hand(linear, runs, tokens, tmp_path):
    served = load_final(str(runs / "linear"))
    x = _pixels(2, seed=2)
    z, generic = _logits(served, x)
    for cid in CLIENT_IDS:
        expected = (generic + z @ served.personal_heads[cid].T).softmax(1)
        r = linear.post("/v1/predict", json={"images": x.tolist(), "client_id": cid}, headers=bearer(tokens[cid]))
        assert r.status_code == 200
        personal = r.json()["personalized"]
        assert personal["by"] == "client_id" and personal["client_id"] == cid and personal["head_id"] is None
        assert personal["personalized"] is True and personal["note"] is None
        assert torch.allclose(torch.tensor(personal["probabilities"]), expected, atol=1e-5)
    # A client the token file lists but the model has no head for.
    path = tmp_path / "tokens.json"
    (token,) = client_tokens(path, [2]).values()
    with TestClient(create_app(Settings(model_dir=str(runs / "linear"), client_tokens=str(path)))) as other:
        r = other.post("/v1/predict", json={"images": x.tolist(), "client_id": 2}, headers=bearer(token))
    assert r.status_code == 404 and r.json() == {"detail": "client_id: no client 2 in this model",
                                                 "field": "client_id"}
    r = linear.post("/v1/predict", json={"images": x.tolist(), "class_counts": [1] * 10})
    assert r.status_code == 409 and r.json()["field"] == "class_counts"


def test_a_zero_head_says_it_is_not_personalized(tmp_path):
    make_final(tmp_path / "linear", "linear", zero_clients=(7,))
    make_final(tmp_path / "hyper", "hyper", zero_hypernet=True)
    x = _pixels(2, seed=3).tolist()
    tokens = client_tokens(tmp_path / "tokens.json", [*CLIENT_IDS, 7])
    settings = Settings(model_dir=str(tmp_path / "linear"), client_tokens=str(tmp_path / "tokens.json"))
    with TestClient(create_app(settings, admin_token=TOKEN)) as linear:
        info = linear.get("/v1/model", headers=ADMIN).json()
        assert info["client_ids"] == [*CLIENT_IDS, 7] and info["trained_client_ids"] == list(CLIENT_IDS)
        body = linear.post("/v1/predict", json={"images": x, "client_id": 7}, headers=bearer(tokens[7])).json()
        personal = body["personalized"]
        assert personal["personalized"] is False and personal["client_id"] == 7
        assert "client 7's head is all zero" in personal["note"] and "generic" in personal["note"]
        assert personal["probabilities"] == body["generic"]["probabilities"]
        assert linear.post("/v1/predict", json={"images": x, "client_id": 0}, headers=bearer(tokens[0])).json()[
            "personalized"]["personalized"] is True
    with TestClient(create_app(str(tmp_path / "hyper"))) as hyper:
        body = hyper.post("/v1/predict", json={"images": x, "class_counts": [1] * 10}).json()
        personal = body["personalized"]
        assert personal["personalized"] is False and "all-zero head" in personal["note"]
        assert personal["probabilities"] == body["generic"]["probabilities"]


def test_plain_model_predicts_generic_only(plain, hyper):
    x = _pixels(1).tolist()
    assert plain.post("/v1/predict", json={"images": x}).json()["personalized"] is None
    for selector in ({"client_id": 0}, {"head_id": "0" * 32}, {"class_distribution": [1] * 10}):
        r = plain.post("/v1/predict", json={"images": x, **selector})
        assert r.status_code == 409 and r.json()["field"] == next(iter(selector)), selector
    r = hyper.post("/v1/predict", json={"images": x, "client_id": 0})
    assert r.status_code == 409 and "linear" in r.json()["detail"]


def test_the_example_png_is_a_seven():
    img = Image.open(io.BytesIO(base64.b64decode(EXAMPLE_PNG)))
    assert img.size == (28, 28) and img.mode == "L"


# --- bad input: a 4xx naming the field, and no change -----------------------------------------------------

IMG = [[[0] * 28 for _ in range(28)]]


def _rgb_png():
    return _png(torch.zeros(28, 28, 3, dtype=torch.uint8), "RGB")


def _small_png():
    return _png(torch.zeros(27, 28, dtype=torch.uint8))


def _truncated_png():
    data = base64.b64decode(_png(_pixels(1)[0, 0]))
    return base64.b64encode(data[: len(data) // 2]).decode()


BAD_HEADS = [
    ({"class_distribution": [0.1] * 9}, "class_distribution", "9 entries"),
    ({"class_counts": [1] * 11}, "class_counts", "11 entries"),
    ({"class_distribution": [0.2, -0.1] + [0.1] * 8}, "class_distribution[1]", "greater than or equal to 0"),
    ({"class_distribution": [0] * 10}, "class_distribution", "all zero"),
    ({"class_counts": [0] * 10}, "class_counts", "all zero"),
    ({"class_counts": [1.5] + [1] * 9}, "class_counts[0]", "integer"),
    ({"class_counts": [1] * 9 + [-3]}, "class_counts[9]", "greater than or equal to 0"),
    ({"class_counts": ["1"] * 10}, "class_counts[0]", "integer"),
    ({"class_distribution": [True] * 10}, "class_distribution[0]", "number"),
    ({"class_distribution": [1e308] * 10}, "class_distribution", "float"),
    ({"class_distribution": []}, "class_distribution", "at least 1"),
    ({}, "class_distribution", "exactly one"),
    ({"class_counts": [1] * 10, "class_distribution": [1] * 10}, "class_distribution", "exactly one"),
    ({"class_count": [1] * 10}, "class_count", "Extra inputs"),
]


@pytest.mark.parametrize("body,field,words", BAD_HEADS, ids=[f"{b[1]}-{b[2]}" for b in BAD_HEADS])
def test_bad_head_requests(hyper, body, field, words):
    r = hyper.post("/v1/heads", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field and r.json()["detail"].startswith(field) and words in r.json()["detail"]
    assert len(_served(hyper).heads) == 0


@pytest.mark.parametrize("text,field", [
    ('{"class_distribution": [NaN, 1, 1, 1, 1, 1, 1, 1, 1, 1]}', "class_distribution[0]"),
    ('{"class_distribution": [1, 1, 1, 1, 1, 1, 1, 1, 1, Infinity]}', "class_distribution[9]"),
    ('{"class_distribution": [1, 1', "body"),
    ("[]", "body"),
    (b'{"class_counts": "\xc0\xff"}', "body"),
])
def test_non_finite_and_broken_json(hyper, text, field):
    r = hyper.post("/v1/heads", content=text, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == field, r.text


BAD_PREDICTS = [
    ({"images": [[IMG[0], IMG[0]]]}, "images[0]", "has 2 channels"),
    ({"images": [[IMG[0][:27]]]}, "images[0][0]", "has 27 rows"),
    ({"images": [IMG, [IMG[0][:27] + [[0] * 27]]]}, "images[1][0][27]", "has 27 pixels"),
    ({"images": [[[[0] * 28] * 27 + [[0] * 27 + [256]]]]}, "images[0][0][27][27]", "outside 0..255"),
    ({"images": [[[[-1] + [0] * 27] + [[0] * 28] * 27]]}, "images[0][0][0][0]", "outside 0..255"),
    ({"images": [[[[3.5] * 28] * 28]], "pixels": "normalized"}, "images[0][0][0][0]", "[-0.4252, 2.8225]"),
    ({"images": [[[["a"] * 28] * 28]]}, "images[0][0][0][0]", "number"),
    ({"images": [[[0] * 28] * 28]}, "images[0][0][0]", "valid array"),
    ({"images": []}, "images", "at least 1"),
    ({"images": [IMG] * 5}, "images", "at most 4"),
    ({"images_png": [EXAMPLE_PNG] * 5}, "images_png", "at most 4"),
    ({}, "images", "exactly one of images, images_png"),
    ({"images": [IMG], "images_png": [EXAMPLE_PNG]}, "images", "exactly one"),
    ({"images_png": [EXAMPLE_PNG], "pixels": "normalized"}, "pixels", "images only"),
    ({"images": [IMG], "pixels": "floats"}, "pixels", "'raw' or 'normalized'"),
    ({"images_png": ["not base64!"]}, "images_png[0]", "base64"),
    ({"images_png": [base64.b64encode(b"GIF89a...").decode()]}, "images_png[0]", "not a PNG"),
    ({"images_png": [EXAMPLE_PNG, _small_png()]}, "images_png[1]", "28x27 pixels"),
    ({"images_png": [_rgb_png()]}, "images_png[0]", "mode RGB"),
    ({"images_png": [_truncated_png()]}, "images_png[0]", "is truncated"),
    ({"images": [IMG], "top_k": 0}, "top_k", "greater than or equal to 1"),
    ({"images": [IMG], "top_k": 11}, "top_k", "only 10 classes"),
    # Strict numbers, as the schema's "integer" says: no strings, booleans or fractions (2.0 is 2:
    # test_integral_floats_are_the_integers_the_schema_allows).
    ({"images": [IMG], "top_k": "3"}, "top_k", "valid integer"),
    ({"images": [IMG], "top_k": True}, "top_k", "valid integer"),
    ({"images": [IMG], "top_k": 2.5}, "top_k", "valid integer"),
    ({"images": [IMG], "client_id": 1.5}, "client_id", "valid integer"),
    ({"images": [IMG], "class_counts": [2.5] * 10}, "class_counts[0]", "valid integer"),
    ({"images": [IMG], "head_id": "xyz"}, "head_id", "pattern"),
    ({"images": [IMG], "client_id": -1}, "client_id", "greater than or equal to 0"),
    ({"images": [IMG], "class_counts": [1] * 10, "head_id": "0" * 32}, "head_id", "at most one"),
    ({"images": [IMG], "class_counts": [1] * 9}, "class_counts", "9 entries"),
    ({"images": [IMG], "class_distribution": [0.0] * 10}, "class_distribution", "all zero"),
]


@pytest.mark.parametrize("body,field,words", BAD_PREDICTS, ids=[f"{b[1]}-{b[2]}" for b in BAD_PREDICTS])
def test_bad_predict_requests(hyper, body, field, words):
    r = hyper.post("/v1/predict", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field and r.json()["detail"].startswith(field), r.json()
    assert words in r.json()["detail"], r.json()
    assert len(_served(hyper).heads) == 0  # even a valid class_counts next to bad images made no head


def test_integral_floats_are_the_integers_the_schema_allows(hyper):
    """JSON Schema's "integer" (the OpenAPI document's) holds 9.0 and 473475.0: the server takes them as
    the integers they are, with the same answers (issue 49: it answered 422)."""
    counts = [473475, 0, 3, 0, 0, 45, 0, 310, 0, 2]
    as_int = hyper.post("/v1/predict", json={"images": [IMG], "class_counts": counts, "top_k": 9})
    as_float = hyper.post("/v1/predict", content=json.dumps(
        {"images": [IMG], "class_counts": [float(c) for c in counts], "top_k": 9.0}),
        headers={"content-type": "application/json"})
    assert as_float.status_code == 200, as_float.text
    assert as_float.json() == as_int.json()
    assert len(as_float.json()["generic"]["top_k"][0]) == 9


def test_unknown_head_id(hyper):
    r = hyper.post("/v1/predict", json={"images": [IMG], "head_id": "0" * 32})
    assert r.status_code == 404 and r.json()["field"] == "head_id"
    assert hyper.get("/v1/heads/" + "0" * 32).status_code == 404
    r = hyper.get("/v1/heads/not-an-id")
    assert r.status_code == 422 and r.json()["field"] == "head_id"


def test_body_over_the_limit_is_413(hyper):
    big = {"images": [IMG] * 4, "pad": "x" * 2**16}
    r = hyper.post("/v1/predict", json=big)
    assert r.status_code == 413 and r.json()["field"] == "body" and str(2**16) in r.json()["detail"]

    def chunks():  # no Content-Length: the middleware has to count
        yield b'{"images_png": ["'
        for _ in range(80):
            yield b"A" * 1024
        yield b'"]}'

    r = hyper.post("/v1/predict", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "more than" in r.json()["detail"]
    assert hyper.post("/v1/heads", content=b"[" + b"1," * 40000 + b"1]").status_code == 413
    assert hyper.get("/readyz").status_code == 200


@pytest.mark.parametrize("headers,field,words", [
    ({"content-type": "application/x-www-form-urlencoded"}, "Content-Type", "takes application/json"),
    ({"content-type": "text/plain"}, "Content-Type", "'text/plain'"),
    ({"content-type": "application/vnd.api+json"}, "Content-Type", "takes application/json"),
    ({"content-type": "application/json; charset=latin-1"}, "Content-Type", "UTF-8"),
    ({}, "Content-Type", "missing"),
    ({"content-type": "application/json", "content-encoding": "gzip"}, "Content-Encoding", "gzip is not"),
])
def test_not_a_plain_json_body_is_415(hyper, headers, field, words):
    body = json.dumps({"class_counts": [1] * 10}).encode()
    r = hyper.post("/v1/heads", content=body, headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["field"] == field and r.json()["detail"].startswith(field) and words in r.json()["detail"]
    ok = hyper.post("/v1/heads", content=body, headers={"content-type": "application/json; charset=UTF-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("path,text,key", [
    ("/v1/heads", '{"class_counts": [1,1,1,1,1,1,1,1,1,1], "class_counts": [2,1,1,1,1,1,1,1,1,1]}', "class_counts"),
    ("/v1/predict", '{"images": [[[' + ",".join(["[" + ",".join(["0"] * 28) + "]"] * 28) + ']]], "top_k": 1, '
                    '"top_k" : 2}', "top_k"),
    ("/v1/heads", '{"class_counts": [1,1,1,1,1,1,1,1,1,1], "class_\\u0063ounts": [1,1,1,1,1,1,1,1,1,1]}',
     "class_counts"),
    ("/v1/admin/reload", '{"model_dir": "a", "model_dir": "b"}', "model_dir"),
], ids=["heads", "predict", "escaped", "reload"])
def test_duplicate_keys_are_422_naming_the_key(hyper, path, text, key):
    r = hyper.post(path, content=text, headers={"content-type": "application/json", **ADMIN})
    assert r.status_code == 422 and r.json()["field"] == key, r.text
    assert r.json()["detail"] == f"{key}: is given more than once in the body; give each field once"
    # A key inside a string value is no key: this reload looks for a directory of that name.
    r = hyper.post("/v1/admin/reload", json={"model_dir": 'x", "model_dir": "y'}, headers=ADMIN)
    assert r.status_code == 409 and "meta.json does not exist" in r.json()["detail"], r.text


def _png_bytes():
    return base64.b64decode(_png(_pixels(1)[0, 0]))


def _bad_crc():
    data = bytearray(_png_bytes())
    data[30] ^= 0xFF  # a byte of IHDR's checksum
    return bytes(data)


@pytest.mark.parametrize("data,words", [
    (lambda: _png_bytes()[:-20], "is truncated: its 'IDAT' chunk needs"),
    (lambda: _png_bytes()[:-12], "is truncated: it ends before its IEND chunk"),
    (_bad_crc, "has a bad checksum (CRC) in its 'IHDR' chunk"),
    (lambda: _png_bytes()[:8], "is truncated: it holds only the PNG signature"),
    (lambda: _png_bytes()[:8] + b"\0\0\0\0IEND\xaeB`\x82", "is not a PNG image: its first chunk is 'IEND'"),
], ids=["cut-in-data", "no-iend", "bad-crc", "signature-only", "no-ihdr"])
def test_broken_pngs_say_what_is_wrong(hyper, data, words):
    r = hyper.post("/v1/predict", json={"images_png": [EXAMPLE_PNG, base64.b64encode(data()).decode()]})
    assert r.status_code == 422 and r.json()["field"] == "images_png[1]", r.text
    assert words in r.json()["detail"] and "0x" not in r.json()["detail"], r.json()


def test_swagger_ui_fetches_nothing_from_outside(hyper):
    page = hyper.get("/docs").text
    assert '"validatorUrl": null' in page
    assert not re.findall(r"https?://(?!127\.0\.0\.1|localhost)[\w.-]+", page.replace("http://testserver", ""))


@pytest.mark.parametrize("text,words", [
    ("[" * 1000 + "]" * 1000, "nested more than 200"),
    ('{"class_counts": [' + "9" * 5000 + "]}", "too large to read"),
    ('{"class_counts": [1, 1', "invalid JSON: EOF while parsing a list at line 1 column 22"),
    ('{"class_counts": [1 1]}', "invalid JSON: expected `,` or `]`"),
    (b'{"class_counts": "\xc0\xff"}', "not valid UTF-8"),
    ("", "is empty"),
])
def test_unparsable_bodies_say_why(hyper, text, words):
    r = hyper.post("/v1/heads", content=text, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "body", r.text
    assert words in r.json()["detail"], r.text


def test_more_values_than_a_request_can_need_is_413_before_parsing(hyper):
    # hyper: max_batch 4 of 1x28x28, 10 classes. A body of tiny images or of zeros, well under the byte limit.
    tiny = hyper.post("/v1/predict", content=b'{"images": [' + b",".join([b"[[[0]]]"] * 5000) + b"]}",
                      headers={"content-type": "application/json"})
    assert tiny.status_code == 413 and tiny.json()["field"] == "body", tiny.text
    assert "4 images of shape [1, 28, 28] and 10 classes" in tiny.json()["detail"]
    zeros = hyper.post("/v1/heads", content=b'{"class_distribution": [' + b"0," * 20000 + b"0]}",
                       headers={"content-type": "application/json"})
    assert zeros.status_code == 413 and "JSON values" in zeros.json()["detail"], zeros.text
    # A request a few images or classes over the limit still gets the 422 naming the field.
    assert hyper.post("/v1/predict", json={"images": [IMG] * 8}).status_code == 422
    assert hyper.post("/v1/heads", json={"class_counts": [1] * 40}).json()["field"] == "class_counts"


def test_unknown_route_and_method(hyper):
    r = hyper.get("/v1/nothing")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found", "field": None}
    assert hyper.get("/v1/predict").status_code == 405


# --- reload ---------------------------------------------------------------------------------------------


def _predict(client):
    return client.post("/v1/predict", json={"images": _pixels(1).tolist()}).json()


def test_reload_needs_the_token(hyper, runs):
    r = hyper.post("/v1/admin/reload")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["field"] == "Authorization"
    r = hyper.post("/v1/admin/reload", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with TestClient(create_app(str(runs / "hyper"))) as disabled:
        r = disabled.post("/v1/admin/reload", headers=ADMIN)
        assert r.status_code == 403 and "FEDROD_ADMIN_TOKEN" in r.json()["detail"]
    with TestClient(create_app(str(runs / "hyper"), admin_token="")) as disabled:
        assert disabled.post("/v1/admin/reload", headers={"Authorization": "Bearer "}).status_code == 403


def test_reload_a_new_model(hyper, runs, tmp_path):
    before = _predict(hyper)
    head = hyper.post("/v1/heads", json={"class_counts": [1] * 10}).json()["head_id"]
    r = hyper.post("/v1/admin/reload", headers=ADMIN)
    assert r.json() == {"version_id": before["model_version"], "previous_version_id": before["model_version"],
                        "changed": False}
    assert hyper.get(f"/v1/heads/{head}").status_code == 200  # the same version keeps its heads

    new_version = make_final(tmp_path / "run", "hyper", seed=7)  # training wrote a new final/
    r = hyper.post("/v1/admin/reload", headers=ADMIN, json={})
    assert r.status_code == 200
    assert r.json() == {"version_id": new_version, "previous_version_id": before["model_version"],
                        "changed": True}
    after = _predict(hyper)
    assert after["model_version"] == new_version and after["generic"] != before["generic"]
    assert hyper.get(f"/v1/heads/{head}").status_code == 404  # a head of the old model is gone

    # Another run directory, e.g. a linear model.
    r = hyper.post("/v1/admin/reload", headers=ADMIN, json={"model_dir": str(runs / "linear")})
    assert r.status_code == 200 and hyper.get("/v1/model").json()["head"] == "linear"
    assert hyper.post("/v1/heads", json={"class_counts": [1] * 10}).status_code == 409


def _truncate(run):
    path = run / "final" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def _drop_meta(run):
    (run / "final" / "meta.json").unlink()


def _hand_edit(run):
    meta = run / "final" / "meta.json"
    doc = json.loads(meta.read_text())
    doc["round"] = 99
    meta.write_text(json.dumps(doc))


@pytest.mark.parametrize("damage,words", [(_truncate, "model.safetensors"), (_drop_meta, "meta.json"),
                                          (_hand_edit, "version_id")])
def test_reload_refuses_a_broken_final_and_keeps_serving(hyper, tmp_path, damage, words):
    before = _predict(hyper)
    info = hyper.get("/v1/model").json()
    damage(tmp_path / "run")
    r = hyper.post("/v1/admin/reload", headers=ADMIN)
    assert r.status_code == 409 and r.json()["field"] == "model_dir"
    assert words in r.json()["detail"]
    assert f"still serving version {before['model_version']}" in r.json()["detail"]
    assert _predict(hyper) == before and hyper.get("/v1/model").json() == info
    assert hyper.get("/readyz").status_code == 200


def test_reload_of_a_missing_or_unknown_dir(hyper, tmp_path):
    version = _predict(hyper)["model_version"]
    r = hyper.post("/v1/admin/reload", headers=ADMIN, json={"model_dir": str(tmp_path / "nothing")})
    assert r.status_code == 409 and "meta.json does not exist" in r.json()["detail"]
    r = hyper.post("/v1/admin/reload", headers=ADMIN, json={"model_dir": "nosuchscheme://bucket/run"})
    assert r.status_code == 422 and r.json()["field"] == "model_dir"
    r = hyper.post("/v1/admin/reload", headers=ADMIN, json={"model_dir": ""})
    assert r.status_code == 422 and r.json()["field"] == "model_dir"
    assert _predict(hyper)["model_version"] == version
    # The next plain reload still means the directory being served, not the refused one.
    assert hyper.post("/v1/admin/reload", headers=ADMIN).json()["changed"] is False


# --- start-up -------------------------------------------------------------------------------------------


def test_a_model_that_cannot_be_served_never_starts(tmp_path, runs):
    with pytest.raises(ExportError, match="meta.json"):
        create_app(str(tmp_path))
    shutil.copytree(runs / "hyper", tmp_path / "nan")
    served = load_final(str(tmp_path / "nan"))
    weights = {k: v.clone() for k, v in served.model.state_dict().items()}
    weights["generic_head.weight"][0, 0] = float("nan")
    save_final(RunStorage(str(tmp_path / "nan")), served.meta, weights)
    with pytest.raises(ExportError, match="generic_head.weight has non-finite"):
        create_app(str(tmp_path / "nan"))


@pytest.mark.slow
def test_api_imports_neither_ray_nor_training_code():
    # Besides export, its storage and the models: only fedrod_ray.data, for the normalisation training uses, and
    # the torch-free config and specs (model.init's choices).
    check = ("import sys, fedrod_ray_api.app; bad = [m for m in sys.modules if m == 'ray' or m.startswith('ray.') or "
             "(m.split('.')[0] == 'fedrod_ray' and m not in ('fedrod_ray', 'fedrod_ray.models.export', "
             "'fedrod_ray.outputs', 'fedrod_ray.outputs.storage') and not m.startswith(('fedrod_ray.models', "
             "'fedrod_ray.data', 'fedrod_ray.config', 'fedrod_ray.specs')))]; "
             "assert not bad, bad")
    subprocess.run([sys.executable, "-c", check], cwd=REPO, check=True)
