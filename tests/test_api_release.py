"""What the service hands out, tried as someone who is not the client or the operator: a training client's
own head (un-noised) goes only to that client, and only when the operator turned it on; who took part in
training only to the admin; a private model says what its epsilon covers and where its noise came from.
Zero-shot heads of new clients stay public: they are made from the released model alone."""

from __future__ import annotations

import hashlib
import json
import typing

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from fedrod_ray_api.app import create_app
from fedrod_ray_api.client_tokens import ClientTokensError, parse
from fedrod_ray_api.schemas import GUARANTEES, NOT_COVERED, PrivacyInfo
from fedrod_ray_api.settings import Settings
from served import CLIENT_IDS, bearer, client_tokens, edit_meta, make_final, uvicorn_server

from fedrod_ray.cli import main
from fedrod_ray.models.export import NOISE_SOURCES, load_final

ADMIN_TOKEN = "release-admin-token"
IMAGES = torch.randint(0, 256, (2, 1, 28, 28), generator=torch.Generator().manual_seed(4)).tolist()
COUNTS = [120, 0, 3, 0, 0, 45, 0, 310, 0, 2]
SEED_WARNING = "not private against anyone who knows the seed"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    make_final(root / "linear", "linear", zero_clients=(7,))
    make_final(root / "hyper", "hyper")
    return root


@pytest.fixture(scope="module")
def tokens(runs):
    return client_tokens(runs / "tokens.json", [*CLIENT_IDS, 7])


def _app(runs, head="linear", tokens_file=True, admin_token=ADMIN_TOKEN):
    settings = Settings(model_dir=str(runs / head),
                        client_tokens=str(runs / "tokens.json") if tokens_file else None)
    return TestClient(create_app(settings, admin_token=admin_token))


def _personal(runs, cid: int) -> list:
    """Client ``cid``'s personalized probabilities of IMAGES, computed from final/ directly."""
    served = load_final(str(runs / "linear"))
    x = (torch.tensor(IMAGES, dtype=torch.float32) / 255 - served.meta.mean[0]) / served.meta.std[0]
    with torch.no_grad():
        z = served.model.features(x)
        return (served.model.generic_head(z) + z @ served.personal_heads[cid].T).softmax(1)


def _refused(r, status: int, field: str) -> None:
    assert r.status_code == status, r.text
    assert set(r.json()) == {"detail", "field"} and r.json()["field"] == field, r.json()
    assert r.json()["detail"].startswith(f"{field}: ")


# --- a training client's own head ---------------------------------------------------------------------------


def test_no_client_head_without_client_tokens(runs):
    """The default: nobody gets a training client's head, the admin included."""
    with _app(runs, tokens_file=False) as client:
        for headers in ({}, bearer(ADMIN_TOKEN)):
            r = client.post("/v1/predict", json={"images": IMAGES, "client_id": 5}, headers=headers)
            _refused(r, 403, "client_id")
            assert "--client-tokens" in r.json()["detail"]
        # The generic predictions stay public.
        assert client.post("/v1/predict", json={"images": IMAGES}).status_code == 200


def test_a_client_head_goes_only_to_that_client(runs, tokens):
    digests = json.loads((runs / "tokens.json").read_text())
    with _app(runs) as client:
        def predict(cid, headers):
            return client.post("/v1/predict", json={"images": IMAGES, "client_id": cid}, headers=headers)

        attempts = {
            "no token": {},
            "another client's token": bearer(tokens[0]),
            "a guessed token": bearer("client-5-guess"),
            "the digest from the token file": bearer(digests["5"]),
            "the admin token": bearer(ADMIN_TOKEN),
            "the token in another scheme": {"Authorization": f"Basic {tokens[5]}"},
            "an empty bearer": {"Authorization": "Bearer "},
        }
        for what, headers in attempts.items():
            r = predict(5, headers)
            _refused(r, 401, "Authorization")
            assert "client_id 5" in r.json()["detail"], what
            assert r.headers["WWW-Authenticate"] == "Bearer"
        # An id the token file does not list answers as a wrong token does: whether it exists is not said.
        for cid in (2, 10**6):
            _refused(predict(cid, bearer(tokens[5])), 401, "Authorization")
        # Its own token: its head.
        for cid in (5, 0):
            r = predict(cid, bearer(tokens[cid]))
            assert r.status_code == 200 and r.json()["personalized"]["client_id"] == cid
            assert torch.allclose(torch.tensor(r.json()["personalized"]["probabilities"]), _personal(runs, cid),
                                  atol=1e-5)


def test_zero_shot_heads_stay_public(runs, tokens):
    """A new client's head from its class counts is made from the released model alone: no token."""
    with _app(runs, "hyper", tokens_file=False) as client:
        head = client.post("/v1/heads", json={"class_counts": COUNTS})
        assert head.status_code == 200
        assert client.get(f"/v1/heads/{head.json()['head_id']}").status_code == 200
        r = client.post("/v1/predict", json={"images": IMAGES, "class_counts": COUNTS})
        assert r.status_code == 200 and r.json()["personalized"]["head_id"] == head.json()["head_id"]
        # A client_id on a model without client heads is still the 409 that says so.
        _refused(client.post("/v1/predict", json={"images": IMAGES, "client_id": 5}), 409, "client_id")


def test_the_openapi_document_says_who_needs_a_token(runs):
    with _app(runs) as client:
        doc = client.get("/openapi.json").json()
    predict = doc["paths"]["/v1/predict"]["post"]
    # Optional: only client_id needs it.
    assert predict["security"] == [{"ClientToken": []}, {}]
    assert {"401", "403"} <= set(predict["responses"])
    assert doc["paths"]["/v1/model"]["get"]["security"] == [{"HTTPBearer": []}, {}]
    assert set(doc["components"]["securitySchemes"]) == {"ClientToken", "HTTPBearer"}


# --- who took part ------------------------------------------------------------------------------------------


def test_the_participants_only_to_the_admin(runs, tokens):
    with _app(runs) as client:
        for headers in ({}, bearer(tokens[5]), bearer("wrong"), {"Authorization": f"Basic {ADMIN_TOKEN}"}):
            info = client.get("/v1/model", headers=headers)
            assert info.status_code == 200
            assert info.json()["client_ids"] is None and info.json()["trained_client_ids"] is None, headers
        info = client.get("/v1/model", headers=bearer(ADMIN_TOKEN)).json()
        assert info["client_ids"] == [*CLIENT_IDS, 7] and info["trained_client_ids"] == list(CLIENT_IDS)
    # A server without an admin token shows them to no one.
    with _app(runs, admin_token=None) as client:
        for headers in ({}, bearer(""), bearer("None")):
            assert client.get("/v1/model", headers=headers).json()["client_ids"] is None


def test_a_known_client_learns_nothing_of_the_others(runs, tokens, tmp_path):
    """Client 2 holds a token but has no head in this model: its 404 does not list who has one."""
    path = tmp_path / "tokens.json"
    (token,) = client_tokens(path, [2]).values()
    settings = Settings(model_dir=str(runs / "linear"), client_tokens=str(path))
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/predict", json={"images": IMAGES, "client_id": 2}, headers=bearer(token))
    _refused(r, 404, "client_id")
    assert not any(str(cid) in r.json()["detail"].replace("client_id", "").replace("client 2", "")
                   for cid in CLIENT_IDS)


# --- the token file -----------------------------------------------------------------------------------------


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not JSON"),
    ("[]", "JSON object"),
    ("{}", "at least one client"),
    (json.dumps([["0", _digest("a")]]), "JSON object"),
    (json.dumps({"05": _digest("a")}), "'05' is not a client id"),
    (json.dumps({"-1": _digest("a")}), "'-1' is not a client id"),
    (json.dumps({"x": _digest("a")}), "'x' is not a client id"),
    (json.dumps({"1": "a"}), "client 1's value must be the sha256 hex digest"),
    (json.dumps({"1": _digest("a")[:-1] + "g"}), "64 hex digits"),
    (json.dumps({"1": 5}), "sha256 hex digest"),
    (f'{{"1": "{_digest("a")}", "1": "{_digest("b")}"}}', "client 1 is listed twice"),
    (json.dumps({"1": _digest("a"), "2": _digest("a")}), "clients 1 and 2 have the same token"),
])
def test_a_bad_token_file_is_refused(text, message):
    with pytest.raises(ClientTokensError, match="tokens.json: ") as e:
        parse(text, "tokens.json")
    assert message in str(e.value)


def test_a_good_token_file(tmp_path):
    tokens = parse(json.dumps({"0": _digest("zero"), "12": _digest("twelve").upper()}), "t.json")
    assert tokens.allows(0, "zero") and tokens.allows(12, "twelve")
    assert not tokens.allows(12, "zero") and not tokens.allows(0, None) and not tokens.allows(3, "zero")


def test_serve_refuses_a_token_file_it_cannot_use(runs, capsys, tmp_path):
    def error(*argv) -> str:
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("fedrod-ray: error: --client-tokens: "), err
        return err

    linear, hyper = str(runs / "linear"), str(runs / "hyper")
    assert "cannot read it" in error(linear, "--client-tokens", str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"1": "x"}')
    for ray in ((), ("--ray",)):  # --ray: before any Ray starts
        assert "sha256 hex digest" in error(linear, "--client-tokens", str(tmp_path / "bad.json"), *ray)
        # A model without client heads: the tokens would do nothing.
        assert "stores no per-client heads" in error(hyper, "--client-tokens", str(runs / "tokens.json"), *ray)


# --- what epsilon covers ------------------------------------------------------------------------------------


PRIVACY = {"epsilon": 7.9, "delta": 1e-5, "noise_multiplier": 1.1, "clip_norm": 1.0, "adaptive_clip": False,
           "sampling": "poisson", "sampling_rate": 0.1, "accountant": "rdp"}


@pytest.mark.parametrize(("privacy", "noise", "private_against_seed"), [
    ({**PRIVACY, "noise": "secure"}, "secure", True),
    ({**PRIVACY, "noise": "seeded"}, "seeded", False),
    (PRIVACY, "seeded", False),  # a final/ from before the field: seeded
])
def test_a_private_model_says_what_epsilon_covers(tmp_path, privacy, noise, private_against_seed):
    make_final(tmp_path, "hyper")
    edit_meta(tmp_path, privacy=privacy)
    with TestClient(create_app(str(tmp_path))) as client:
        info = client.get("/v1/model").json()["privacy"]
    assert info["epsilon"] == 7.9 and info["noise"] == noise
    assert (SEED_WARNING in info["guarantee"]) is not private_against_seed
    assert "(epsilon, delta)-DP" in info["guarantee"]
    uncovered = " ".join(info["not_covered"])
    assert info["not_covered"] == NOT_COVERED
    for what in ("metrics", "personal heads", "checkpoints"):
        assert what in uncovered


def test_every_noise_source_has_its_guarantee():
    """A source final/meta.json may name (export.NOISE_SOURCES) that the service could not describe would
    answer /v1/model with a 500."""
    assert set(typing.get_args(PrivacyInfo.model_fields["noise"].annotation)) == set(NOISE_SOURCES)
    assert set(GUARANTEES) == {*NOISE_SOURCES, "none"}


def test_a_model_without_noise_says_it_has_no_bound(tmp_path):
    make_final(tmp_path, "hyper")
    edit_meta(tmp_path, privacy={**PRIVACY, "epsilon": None, "noise_multiplier": 0.0, "noise": "secure"})
    with TestClient(create_app(str(tmp_path))) as client:
        info = client.get("/v1/model").json()["privacy"]
    assert info["epsilon"] is None and "no finite epsilon" in info["guarantee"]


# --- a real server ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_on_uvicorn(runs, tokens):
    env = {"FEDROD_ADMIN_TOKEN": ADMIN_TOKEN}
    body = {"images": IMAGES, "client_id": 5}
    with uvicorn_server(runs / "linear", env=env) as (_, base, _lines):
        r = httpx.post(f"{base}/v1/predict", json=body, timeout=30)
        _refused(r, 403, "client_id")
        assert httpx.get(f"{base}/v1/model", timeout=30).json()["client_ids"] is None
    flags = ("--client-tokens", str(runs / "tokens.json"))
    with uvicorn_server(runs / "linear", *flags, env=env) as (_, base, _l), httpx.Client(base_url=base,
                                                                                           timeout=30) as http:
        _refused(http.post("/v1/predict", json=body), 401, "Authorization")
        _refused(http.post("/v1/predict", json=body, headers=bearer(tokens[1])), 401, "Authorization")
        r = http.post("/v1/predict", json=body, headers=bearer(tokens[5]))
        assert r.status_code == 200
        assert torch.allclose(torch.tensor(r.json()["personalized"]["probabilities"]), _personal(runs, 5),
                              atol=1e-5)
        assert http.get("/v1/model", headers=bearer(tokens[5])).json()["trained_client_ids"] is None
        assert http.get("/v1/model", headers=bearer(ADMIN_TOKEN)).json()["trained_client_ids"] == list(CLIENT_IDS)


def test_on_ray_serve(ray_session, runs, tokens):
    """The replicas build the same app from the same settings: the token file is one of them. Ray Serve has
    no admin token, so it never lists the participants."""
    from fedrod_ray_api.serve import FedRodAPI
    from ray import serve
    from servers import free_port

    settings = Settings(model_dir=str(runs / "linear"), client_tokens=str(runs / "tokens.json"))
    app = FedRodAPI.options(ray_actor_options={"num_cpus": 0.1}).bind(settings.model_dump())
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app, name="fedrod-release", route_prefix="/")
        body = {"images": IMAGES, "client_id": 5}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            _refused(http.post("/v1/predict", json=body, headers=bearer(tokens[0])), 401, "Authorization")
            r = http.post("/v1/predict", json=body, headers=bearer(tokens[5]))
            assert r.status_code == 200
            assert torch.allclose(torch.tensor(r.json()["personalized"]["probabilities"]), _personal(runs, 5),
                                  atol=1e-5)
            assert http.get("/v1/model", headers=bearer(ADMIN_TOKEN)).json()["client_ids"] is None
    finally:
        serve.shutdown()
