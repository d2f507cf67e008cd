"""The README as the front page (short, its links into docs/ alive, its examples the ones the docs pages
test) and the documentation site's generated references (docs/hooks/generated.py) covering what the code
defines. The site itself is built with ``mkdocs build --strict`` in CI (.ci/run)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

from markdown.extensions.toc import slugify
from test_deploy import cluster_section

from fedrod_ray.config import ExperimentConfig
from fedrod_ray.specs.rules import RULES

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
MAX_README_LINES = 250


def test_the_readme_stays_a_front_page():
    assert len(README.splitlines()) <= MAX_README_LINES


def _anchors(page: Path) -> set[str]:
    """The anchors MkDocs gives a page's headings (its default slugify), and explicit ``{#id}`` ones."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#{1,6} (.+?)\s*$", text, re.MULTILINE)
    anchors = set()
    for heading in headings:
        explicit = re.search(r"\{#([\w-]+)\}$", heading)
        plain = re.sub(r"[`*]", "", heading)
        anchors.add(explicit.group(1) if explicit else slugify(plain, "-"))
    return anchors


def test_every_link_from_the_readme_into_docs_exists():
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", README)
    assert len(links) >= 10, links
    for path, anchor in links:
        target = REPO / path
        assert target.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README links to {path}#{anchor}: no such heading"
    assert (REPO / "CHANGELOG.md").is_file() and "](CHANGELOG.md)" in README


def test_the_anchor_check_reads_headings_as_mkdocs_does(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Top\n\n## The paper's claims\n\n```bash\n# not a heading\n```\n\n### `GET /x` {#get-x}\n")
    assert _anchors(page) == {"top", "the-papers-claims", "get-x"}


def test_the_readmes_cluster_job_is_the_one_the_docs_page_runs():
    """tests/test_deploy.py runs docs/ray.md's block against a head node; the README shows the same."""
    block = re.search(r"```bash\n(.*?)```", cluster_section(), re.DOTALL).group(1)
    assert f"```bash\n{block}```" in README


def test_the_readmes_results_are_those_of_the_results_page():
    """The README's summary of the results is the results page's first section, and its figures are those
    of the tables the publisher wrote further down the page."""
    page = (REPO / "docs" / "results.md").read_text()
    section = README[README.index("\n## Results\n"):README.index("\n## Documentation\n")]
    summary = section[len("\n## Results\n"):section.index("Against the paper's personalized-FL baselines")].strip()
    first = page[page.index("\n## The main result\n") + len("\n## The main result\n"):page.index("\nThe rest of this page")]
    assert page.index("\n## The main result\n") < page.index("\n### How these were run\n")
    assert first.strip() == summary.replace("](docs/", "](")
    results = page[page.index("\n## Fashion-MNIST: the paper's protocol\n"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert len(rows) >= 7, rows
    for row in rows:
        method, *values = [cell.strip(" ‡§") for cell in row.strip("|").split("|")]
        label = rf"\| {re.escape(method)}[ §‡]*(?=\|)"
        assert values and all(re.search(rf"{label}[^\n]*\| {re.escape(v)} ", results) for v in values), row


def test_the_home_page_opens_with_the_commands_to_set_up_run_and_test():
    home = (REPO / "docs" / "index.md").read_text()
    block = re.search(r"```bash\n(.*?)```", home, re.DOTALL)
    setup = re.search(r"```bash\n(pip install .*)\n```", README).group(1)
    assert block.start() < home.index("| you want to |")
    assert block.group(1).splitlines() == [setup, "python -m pytest -q"]


def _shape(line: str) -> str:
    """A console line with its figures replaced by N: which fields it has, in which order."""
    return re.sub(r"\d+(?:\.\d+)?(?:e-?\d+)?", "N", " ".join(line.split()))


def test_the_sample_round_line_has_the_fields_the_quickstart_prints(tmp_path):
    """The README's and Getting started's sample of the quickstart's round line has exactly the fields the
    console prints for that config, in its order (its figures are an example): the quickstart itself runs,
    on a few generated images instead of MNIST."""
    import contextlib
    import io

    import torch

    from fedrod_ray.cli import main

    out, threads = io.StringIO(), torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["train", "--config", str(REPO / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path / "r"),
                       "--set", "data.dataset=synthetic", "--set", "data.synthetic_train_per_class=30",
                       "--set", "data.synthetic_test_per_class=10", "--set", "train.rounds=1",
                       "--set", "runtime.torch_threads=1", "--set", "runtime.progress_seconds=3600"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    (printed,) = [line for line in out.getvalue().splitlines() if line.startswith("[round")]
    for page in (README, (REPO / "docs" / "getting-started.md").read_text()):
        (sample,) = re.findall(r"^\[round .*$", page, re.MULTILINE)
        assert _shape(sample) == _shape(printed), (sample, printed)


def _hook():
    """docs/hooks/generated.py, the MkDocs hook that generates the reference pages."""
    spec = importlib.util.spec_from_file_location("docs_hook", REPO / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(section, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        keys += _keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return keys


def test_the_configuration_reference_lists_every_key_and_rule():
    text = _hook().config_reference()
    keys = _keys(ExperimentConfig())
    assert len(keys) > 50
    missing = [key for key in keys if f"| `{key}` |" not in text]
    assert not missing, missing
    assert all(f"| `{rule}` |" in text for rule in RULES)
    # A field's comment in config.py is its description, "(see NAME)" expanded to NAME's comment.
    assert re.search(r"\| `train\.momentum_buffers` \|.*\| what a client's SGD momentum buffers do", text)


def test_the_cli_reference_has_every_command_and_option():
    from fedrod_ray.cli import build_parser

    text = _hook().cli_reference()
    parser = build_parser()
    (sub,) = [a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    assert {"train", "partition", "list", "schema", "serve", "tune", "reproduce"} <= set(sub.choices)
    for name, command in sub.choices.items():
        assert f"## `fedrod-ray {name}`" in text
        for action in command._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, (name, flag)


def test_the_http_api_reference_has_every_operation():
    hook = _hook()
    doc = hook.openapi_document()
    text = hook.http_api_reference()
    operations = [f"{method.upper()} {path}" for path, ops in doc["paths"].items() for method in ops]
    assert "POST /v1/heads" in operations and "POST /v1/predict" in operations
    assert all(f"### `{op}`" in text for op in operations)
    assert all(f"#### `{name}`" in text for name in doc["components"]["schemas"])


def _publisher(dest: Path | None = None, monkeypatch=None):
    """bench/fmnist_results.py as a module; with ``dest``, reading the published jobs from there."""
    spec = importlib.util.spec_from_file_location("fmnist_results", REPO / "bench" / "fmnist_results.py")
    publisher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(publisher)
    if dest is not None:
        monkeypatch.setattr(publisher, "DEST", dest)
    return publisher


def test_the_results_page_holds_the_tables_the_publisher_writes():
    """bench/fmnist_results.py writes docs/results.md's tables from bench/results/: they are what it writes."""
    publisher = _publisher()
    text = publisher.PAGE.read_text()
    start, end = text.index(publisher.MARK[0]) + len(publisher.MARK[0]), text.index(publisher.MARK[1])
    assert text[start:end] == "\n" + publisher.page_block() + "\n", "run python bench/fmnist_results.py --page-only"


def test_the_main_tables_gather_the_rows_run_as_jobs_of_their_own(tmp_path, monkeypatch):
    """A main table on the page holds the rows of its ROWS_FROM jobs, marked ¶n for the n-th job shown, with
    their footnotes and each job's commit; a job not published yet adds nothing."""
    publisher = _publisher(tmp_path, monkeypatch)
    (tmp_path / "pfl_a0.3").mkdir()
    (tmp_path / "pfl_a0.3" / "COMMIT").write_text("abc1234\n")
    (tmp_path / "pfl_a0.3" / "table.md").write_text(
        "Table main: ...\n\n| method | G-FL (GM) |\n|---|---:|\n| FedPer | 50.00 ⋆ |\n"
        "| FedRep (not finished: round 40 of 100; values at round 40) | 45.00 ⋆ |\n\n⋆ no global model: ...\n")
    table = "Table main: ...\n\n| method | G-FL (GM) |\n|---|---:|\n| FedAvg | 60.00 |\n\n† a note"
    lines = publisher.with_rows_from(table, "main_a0.3").splitlines()
    assert lines[4:7] == ["| FedAvg | 60.00 |", "| ¶1 FedPer | 50.00 ⋆ |",
                          "| ¶1 FedRep (not finished: round 40 of 100; values at round 40) | 45.00 ⋆ |"]
    assert lines[-3:] == ["⋆ no global model: ...", "",
                          "Rows run as jobs of their own (each job's table is below): ¶1 `pfl_a0.3` (commit `abc1234`)."]
    assert "† a note" in lines


def test_a_group_job_not_run_says_its_rows_ran_alone_and_any_other_job_not_run_says_so(tmp_path, monkeypatch):
    publisher = _publisher(tmp_path, monkeypatch)
    block = publisher.page_block()
    assert "(`pfl_plain_a0.1`): not run as a group; the rows the main table marks ¶ ran as jobs of their own." in block
    assert "(`main_a0.1`): not run yet." in block
    assert "`pfedme_a0.1`" not in block  # a row alone, not run: nothing to say


def test_the_rows_run_with_three_seeds_take_seed_0_from_the_main_table_or_the_rows_own_job(tmp_path, monkeypatch):
    """Dir(0.1)'s seeds table: FedAvg's seed 0 from the main table, the best personalized-FL row's from the job
    that ran it alone, the others from seeds_a0.1 and seed3_a0.1; mean ± sample std, each seed's job and commit
    named."""
    from fedrod_ray_tune.report import COLUMNS

    publisher = _publisher(tmp_path, monkeypatch)
    header = "row,seed,status," + ",".join(COLUMNS)
    jobs = {"main_a0.1": [("FedAvg", 0, 0.80), ("FedDyn", 0, 0.70)], "fedrep_a0.1": [("FedRep", 0, 0.60)],
            "seeds_a0.1": [("FedAvg", 1, 0.82), ("FedRep", 1, 0.62), ("FedRep", 2, 0.64)],
            "seed3_a0.1": [("FedAvg", 3, 0.84)]}
    for i, (job, rows) in enumerate(jobs.items()):
        (tmp_path / job).mkdir()
        (tmp_path / job / "COMMIT").write_text(f"c{i}\n")
        (tmp_path / job / "results.csv").write_text("\n".join(
            [header] + [f"{row},{seed},finished," + ",".join(str(acc) for _ in COLUMNS) for row, seed, acc in rows]))
    assert publisher.seeds_table("main_a0.3") == ""  # neither job published
    finished = {job: (tmp_path / job / "results.csv").read_text() for job in ("seeds_a0.1", "seed3_a0.1")}
    for job in finished:
        (tmp_path / job / "results.csv").write_text(header)  # published, no trial finished yet
    assert publisher.seeds_table("main_a0.1") == ""
    for job, text in finished.items():
        (tmp_path / job / "results.csv").write_text(text)
    lines = publisher.seeds_table("main_a0.1").splitlines()
    assert lines[0] == ("**Main table, Dir(0.1): the rows run with more seeds** (mean ± sample std over the seeds each names; "
                        "`main_a0.1` at `c0`, `fedrep_a0.1` at `c1`, `seeds_a0.1` at `c2`, `seed3_a0.1` at `c3`)")
    fedavg, fedrep = (line.split(" | ") for line in lines[4:6])
    assert fedavg[0] == "| FedAvg" and fedavg[1] == publisher.mean_std([0.80, 0.82, 0.84])
    assert fedavg[-1] == "0 (`main_a0.1`), 1 (`seeds_a0.1`), 3 (`seed3_a0.1`) |"
    assert fedrep[0] == "| FedRep" and fedrep[1] == publisher.mean_std([0.60, 0.62, 0.64])
    assert fedrep[-1] == "0 (`fedrep_a0.1`), 1 (`seeds_a0.1`), 2 (`seeds_a0.1`) |"
    assert len(lines) == 6  # FedDyn ran no more seeds


def test_a_job_that_is_starting_is_not_published(tmp_path):
    """A job whose definition is written but whose trials Tune has not created yet has nothing to publish."""
    publisher = _publisher()
    started, starting = list(publisher.JOBS)[:2]
    for job in (started, starting):
        (tmp_path / job).mkdir()
        (tmp_path / job / "reproduce.yaml").write_text("{}")
    (tmp_path / started / "trials").mkdir()
    assert publisher.jobs_in(tmp_path) == [started]


def test_a_job_is_published_over_the_committed_one_only_when_further_along(tmp_path, monkeypatch, capsys):
    """A job that had to start again (its first run's record lost) does not replace what an earlier
    publication committed until it gets further: more trials finished, or as many and more rounds."""
    from fedrod_ray_tune.repro_spec import SPEC_FILE, build_spec
    from fedrod_ray_tune.sweep import start_dir

    publisher = _publisher(tmp_path / "published", monkeypatch)
    monkeypatch.setattr(publisher, "ROOT", tmp_path)
    out = tmp_path / "out"
    start_dir(out / "job", SPEC_FILE, build_spec("ablation", REPO / "configs" / "synthetic_tiny.yaml", [0],
                                                 rows=["FedAvg", "Fed-RoD (linear)"]).to_dict(), "", "")
    (out / "job.log").write_text("=== 2026-11-26T23:23:00Z job (commit e4db8cc)\n")

    def trained(fedavg: int, fedrod: int) -> None:  # each row's trial, as far as its run recorded
        for i, (row, n) in enumerate((("FedAvg", fedavg), ("Fed-RoD (linear)", fedrod))):
            folder = out / "job" / "trials" / f"trial_{i}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "trial.json").write_text(json.dumps({"row": row, "seed": 0}))
            (folder / "metrics.jsonl").write_text("".join(json.dumps({"round": k + 1}) + "\n" for k in range(n)))

    trained(50, 0)
    publisher.publish(out, "job", force=False)
    committed = (tmp_path / "published" / "job" / "results.csv").read_text()
    trained(20, 25)  # started again: 45 rounds in all, against 50
    publisher.publish(out, "job", force=False)
    assert "job: kept what is committed (0 trials finished, 50 rounds in all, against 0 and 45" in capsys.readouterr().out
    assert (tmp_path / "published" / "job" / "results.csv").read_text() == committed
    trained(20, 31)
    publisher.publish(out, "job", force=False)
    assert (tmp_path / "published" / "job" / "results.csv").read_text() != committed
    assert (tmp_path / "published" / "job" / "COMMIT").read_text() == "e4db8cc\n"


def test_a_row_run_alone_replaces_its_grouped_row_where_it_got_further(tmp_path, monkeypatch):
    """A personalized-FL row run alone (deploy/reproduce_fmnist.sh's ditto_a0.3) shows in the main table in
    place of the same method's row of a grouped job when it got further, and not when it got less far."""
    publisher = _publisher(tmp_path, monkeypatch)
    head = "Table main: ...\n\n| method | G-FL (GM) |\n|---|---:|\n"
    for job, rows in {"pfl_tuned_a0.3": ["MTL (not finished: round 90 of 100; values at round 80) | 79.00 ⋆",
                                         "Ditto (not started) | -"],
                      "ditto_a0.3": ["Ditto (not finished: round 45 of 100; values at round 40) | 80.00 ⋆"],
                      "mtl_a0.3": ["MTL (not finished: round 30 of 100; values at round 20) | 70.00 ⋆"]}.items():
        (tmp_path / job).mkdir()
        (tmp_path / job / "COMMIT").write_text(f"{job[:4]}123\n")
        (tmp_path / job / "table.md").write_text(head + "".join(f"| {row} |\n" for row in rows))
    table = head + "| FedAvg | 60.00 |"
    lines = publisher.with_rows_from(table, "main_a0.3").splitlines()
    assert lines[4:] == ["| FedAvg | 60.00 |",
                         "| ¶1 MTL (not finished: round 90 of 100; values at round 80) | 79.00 ⋆ |",
                         "| ¶2 Ditto (not finished: round 45 of 100; values at round 40) | 80.00 ⋆ |", "",
                         ("Rows run as jobs of their own (each job's table is below): ¶1 `pfl_tuned_a0.3` (commit "
                          "`pfl_123`), ¶2 `ditto_a0.3` (commit `ditt123`).")]
    assert publisher.progress("| FedPer | 50.00 |") == ("FedPer", float("inf"))


def test_a_new_client_method_run_alone_is_appended_to_the_new_clients_table(tmp_path, monkeypatch):
    """FedBABU's new-clients row (fedbabu_new_clients) shows in the new-clients table, marked with its job."""
    publisher = _publisher(tmp_path, monkeypatch)
    head = "Table new-clients: ...\n\n| method | new before | new after |\n|---|---:|---:|\n"
    (tmp_path / "fedbabu_new_clients").mkdir()
    (tmp_path / "fedbabu_new_clients" / "COMMIT").write_text("babu123\n")
    (tmp_path / "fedbabu_new_clients" / "table.md").write_text(head + "| FedBABU | 80.00 | 90.00 |\n")
    table = head + "| FedAvg | 86.11 | 88.00 |"
    assert publisher.with_rows_from(table, "new_clients").splitlines()[4:] == [
        "| FedAvg | 86.11 | 88.00 |", "| ¶1 FedBABU | 80.00 | 90.00 |", "",
        "Rows run as jobs of their own (each job's table is below): ¶1 `fedbabu_new_clients` (commit `babu123`)."]


def test_a_pair_run_alone_takes_its_place_in_the_privacy_table(tmp_path, monkeypatch):
    """The privacy table's pair at one epsilon run alone (privacy_eps8) replaces that pair's rows in place where
    it got further; rows it did not get further than stay as the table has them, unmarked."""
    publisher = _publisher(tmp_path, monkeypatch)
    head = "Table privacy: ...\n\n| method | G-FL (GM) |\n|---|---:|\n"
    (tmp_path / "privacy_eps8").mkdir()
    (tmp_path / "privacy_eps8" / "COMMIT").write_text("eps8123\n")
    (tmp_path / "privacy_eps8" / "table.md").write_text(
        head + "| FedAvg, ε = 8 (not finished: round 30 of 100; values at round 25) | 70.00 |\n"
        "| Fed-RoD (hyper), ε = 8 (not started) | - |\n")
    table = head + ("| FedAvg, ε = ∞ | 84.00 |\n| FedAvg, ε = 8 (not started) | - |\n"
                    "| Fed-RoD (hyper), ε = 8 (not started) | - |\n\nε: a note")
    assert publisher.with_rows_from(table, "privacy").splitlines()[4:] == [
        "| FedAvg, ε = ∞ | 84.00 |", "| ¶1 FedAvg, ε = 8 (not finished: round 30 of 100; values at round 25) | 70.00 |",
        "| Fed-RoD (hyper), ε = 8 (not started) | - |", "", "ε: a note", "",
        "Rows run as jobs of their own (each job's table is below): ¶1 `privacy_eps8` (commit `eps8123`)."]
    (tmp_path / "privacy_eps8" / "table.md").unlink()
    assert publisher.with_rows_from(table, "privacy") == table


def test_the_setup_command_installs_the_flower_extra_as_pyproject_states_it():
    """README's, the getting-started page's and the docs home's one-line setup install Flower before ``.[dev]``
    (.ci/run reads the same requirement from pyproject.toml): a changed pin must change all of them."""
    import tomllib

    flower = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["flower"]
    setup = f'pip install torch==2.13.0 "{flower[0]}" && pip install -e ".[dev]"'
    assert len(flower) == 1
    for page in ("README.md", "docs/getting-started.md", "docs/index.md"):
        assert setup in (REPO / page).read_text(), page
