"""card.json's declared shape (``qbench.studies.card.schema``), its upgrade from version 1, and ``qbench card
--from-json``: every committed card's pages are a function of its card.json alone."""

from __future__ import annotations

import copy
import json
import shutil
import typing
from pathlib import Path

import pytest

from models.errors import UserError
from qbench.cli import main
from qbench.studies.card.schema import (
    CARD_VERSION,
    Card,
    ComparisonRow,
    FormatRow,
    KVRow,
    ModelSection,
    SensitivitySection,
    Verdict,
)
from qbench.studies.card.upgrade import missing_keys, mistyped_keys, unknown_keys, upgrade
from qbench.studies.card.write import FIGURE_FILE

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "results"
COMMITTED = sorted(RESULTS.glob("**/card.json"))  # results/cards/*, and the demo's under results/demo
NAMES = [str(f.parent.relative_to(RESULTS)) for f in COMMITTED]
REPAIRED = (
    "cards/smollm2-135m-folder-own-text"  # the committed card with a sensitivity section and its repair
)


def _card(name: str) -> dict:
    return json.loads((RESULTS / name / "card.json").read_text())


def _figures(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.glob("card-*.png") if FIGURE_FILE.fullmatch(p.name)}


def _one_line(err: str) -> str:
    assert err.strip() and "\n" not in err.strip(), err
    return err.strip()


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}


# ------------------------------------------------------------------------- the committed cards, re-rendered


@pytest.fixture(scope="module")
def rerendered(tmp_path_factory) -> Path:
    """Every committed card's card.json alone in a folder of its own, re-rendered by ``qbench card --from-json``
    (the first given by its card.json, the others by their folder)."""
    out = tmp_path_factory.mktemp("cards")
    for i, file in enumerate(COMMITTED):
        folder = out / str(file.parent.relative_to(RESULTS)).replace("/", "__")
        folder.mkdir()
        shutil.copy(file, folder / "card.json")
        assert main(["card", "--from-json", str(folder / "card.json" if i == 0 else folder)]) == 0
    return out


def test_there_are_committed_cards():
    assert len(COMMITTED) >= 7 and "demo" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_a_committed_card_is_its_card_json_rendered(rerendered, name):
    """The pages and figures of every committed card are what this qbench writes from their card.json; card.json
    itself is at this version and comes back unchanged."""
    committed, again = RESULTS / name, rerendered / name.replace("/", "__")
    stale = f"results/{name} is stale: qbench card --from-json results/{name}"
    for page in ("card.md", "card.html"):
        assert (again / page).read_bytes() == (committed / page).read_bytes(), f"{page}: {stale}"
    figures, expected = _figures(again), _figures(committed)
    assert sorted(figures) == sorted(expected), stale
    for figure, png in figures.items():
        assert png == expected[figure], f"{figure}: {stale}"
    card = json.loads((again / "card.json").read_text())
    assert card == json.loads((committed / "card.json").read_text()), stale
    assert card["card_version"] == CARD_VERSION


# ------------------------------------------------------------------------------------------- the schema


def _keys(tp) -> set[str]:
    return set(typing.get_type_hints(tp))


@pytest.mark.parametrize("name", NAMES)
def test_the_declared_shape_covers_every_key_of_a_committed_card(name):
    card = _card(name)
    assert unknown_keys(card) == [] and missing_keys(card) == [] and mistyped_keys(card) == []
    assert set(card) == _keys(Card)
    for m in card["models"]:
        # every key the section requires, and of the optional ones (``decisions``: cards before it was counted
        # lack it) only declared ones
        assert ModelSection.__required_keys__ <= set(m) <= _keys(ModelSection)
        assert all(set(f) == _keys(FormatRow) for f in m["formats"])
        assert all(set(r) == _keys(KVRow) for r in m["kv"]["rows"])
        assert set(m["verdict"]) == _keys(Verdict)
        assert m["sensitivity"] is None or set(m["sensitivity"]) == _keys(SensitivitySection)
    assert all(set(c) <= _keys(ComparisonRow) for c in card["comparison"] or [])


def test_the_walk_finds_a_key_the_shape_does_not_declare_and_one_it_lacks():
    card = _card(REPAIRED)
    card["models"][0]["formats"][2]["bytes_vs_fp"] = 0.5
    del card["models"][0]["kv"]["rows"][1]["scheme_name"]
    del card["models"][0]["sensitivity"]["repair"]["beat"]["what"]
    card["models"][0]["verdict"]["avoid"] = {"label": "W4A4 MXFP4"}
    assert unknown_keys(card) == ["models.0.formats.2.bytes_vs_fp"]
    assert missing_keys(card) == [
        "models.0.kv.rows.1.scheme_name",
        "models.0.sensitivity.repair.beat.what",
    ]
    assert mistyped_keys(card) == ["models.0.verdict.avoid"]


# ------------------------------------------------------------------------------------------- the upgrade


@pytest.mark.parametrize("name", NAMES)
def test_a_whole_version_1_card_gets_version_2_and_nothing_else(name):
    card = _card(name)
    v1 = {**card, "card_version": 1}
    assert upgrade(v1) == {**card, "card_version": 2}
    assert v1["card_version"] == 1  # the card passed in is not changed


def test_upgrade_fills_what_a_version_1_card_lacks_and_changes_nothing_else():
    card = _card(REPAIRED)
    v1 = copy.deepcopy({**card, "card_version": 1})
    m = v1["models"][0]
    for repair in (m["sensitivity"]["repair"], m["verdict"]["repair"]):
        del repair["pays"]
    del v1["device"], m["outliers"]["sink_top1_vs_chance"], m["formats"][0]["speed_excludes"]
    del m["sensitivity"]["tries"], m["verdict"]["repair"]["minimised"]
    before = copy.deepcopy(v1)
    up = upgrade(v1, "x/card.json")
    assert v1 == before
    assert up["card_version"] == 2
    tries = up["models"][0]["sensitivity"].pop("tries")
    expected = copy.deepcopy(card)
    expected["card_version"] = 2
    expected["models"][0]["sensitivity"].pop("tries")
    # pays as the build decided it (the repair holds what it had to beat), the device the environment names, the
    # top-1 ratio from its share and chance, a nullable key absent as None (what the pages read for it)
    assert up == expected
    repair = card["models"][0]["sensitivity"]["repair"]
    assert tries == [
        {
            "scheme": card["models"][0]["sensitivity"]["scheme"],
            **{k: repair[k] for k in ("reached", "count", "quantised_ppl_change_pct", "ppl_change_pct")},
            "weight_bytes": repair["weight_bytes"],
            "pays": repair["pays"],
        }
    ]


@pytest.mark.parametrize(
    ("within", "size", "pays"),
    [
        (
            None,
            269_030_144,
            True,
        ),  # no format within the tolerance: a repair that reaches it pays at any size
        (100_000_000, 269_030_144, False),  # not smaller than the smallest format within
        (300_000_000, 269_030_144, True),
    ],
)
def test_a_repair_from_before_the_size_to_beat_pays_as_words_decides(within, size, pays):
    """A section without ``pays`` nor ``beat``: reached, and smaller than the smallest format within the tolerance
    (words.verdict_of's rule for such a section); its ``beat`` says what it was measured against."""
    v1 = {**_card(REPAIRED), "card_version": 1}
    m = v1["models"][0]
    for repair in (m["sensitivity"]["repair"], m["verdict"]["repair"]):
        del repair["pays"], repair["beat"]
        repair["weight_bytes"] = size
    if within:
        m["formats"][4].update(within_tolerance=True, weight_bytes=within)
    up = upgrade(v1)["models"][0]
    assert up["sensitivity"]["repair"]["pays"] is pays and up["verdict"]["repair"]["pays"] is pays
    beat = up["sensitivity"]["repair"]["beat"]
    assert beat["bytes"] == within and beat == up["verdict"]["repair"]["beat"]
    assert up["sensitivity"]["repair"]["reached"]


def test_a_card_from_the_future_is_refused_in_one_line():
    with pytest.raises(UserError) as e:
        upgrade({**_card(REPAIRED), "card_version": 3}, "cards/x/card.json")
    line = _one_line(str(e.value))
    assert "cards/x/card.json" in line and "version 3" in line and "1–2" in line


@pytest.mark.parametrize("version", [None, "2"])
def test_a_json_without_a_card_version_is_refused_in_one_line(version):
    card = _card(REPAIRED)
    del card["card_version"]
    if version is not None:
        card["card_version"] = version
    with pytest.raises(UserError) as e:
        upgrade(card, "cards/x/card.json")
    line = _one_line(str(e.value))
    assert "cards/x/card.json" in line and "card_version" in line and "1–2" in line


@pytest.mark.parametrize("damage", ["lacks", "holds", "mistyped"])
def test_a_version_1_card_of_an_earlier_shape_is_refused_with_the_command_that_builds_it(damage):
    """A key version 2 requires that cannot be filled (not nullable), or one it no longer has: the first cards
    (a dict of one avoided format, sizes against fp32) are not re-rendered but built again from their cells."""
    v1 = {**_card(REPAIRED), "card_version": 1}
    if damage == "lacks":
        del v1["models"][0]["not_measured"]
    elif damage == "holds":
        v1["models"][0]["formats"][0]["bytes_vs_fp"] = 0.3
    else:
        v1["models"][0]["verdict"]["avoid"] = {"label": "W4A4 MXFP4", "scheme": "mxfp4"}
    with pytest.raises(UserError) as e:
        upgrade(v1, "cards/x/card.json")
    line = _one_line(str(e.value))
    assert "cards/x/card.json" in line and "earlier shape" in line and v1["command"] in line
    assert {
        "lacks": "lacks models.0.not_measured",
        "holds": "holds models.0.formats.0.bytes_vs_fp",
        "mistyped": "holds models.0.verdict.avoid in another structure",
    }[damage] in line


# ------------------------------------------------------------------------------------ qbench card --from-json


@pytest.fixture
def written(tmp_path) -> Path:
    """A card's folder holding its card.json alone (nothing rendered: every call here is refused)."""
    folder = tmp_path / "card"
    folder.mkdir()
    shutil.copy(RESULTS / REPAIRED / "card.json", folder / "card.json")
    return folder


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--ckpt", "ckpts/vanilla"], "--ckpt"),
        (["--budget", "standard"], "--budget"),
        (["--output-path", "elsewhere"], "--output-path"),
        (["--no-bos", "--tol", "2"], "--bos, --tolerance"),
        (["--overwrite"], "--overwrite"),
    ],
)
def test_from_json_with_an_option_that_does_not_apply_is_refused_and_writes_nothing(
    written, capsys, extra, named
):
    before = _snapshot(written)
    assert main(["card", "--from-json", str(written), *extra]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--from-json" in line and named in line
    assert _snapshot(written) == before


def test_from_json_refuses_a_folder_without_a_card(tmp_path, capsys):
    assert main(["card", "--from-json", str(tmp_path)]) == 2
    assert "no card.json" in _one_line(capsys.readouterr().err)
    assert main(["card", "--from-json", str(tmp_path / "missing")]) == 2
    assert "does not exist" in _one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_from_json_refuses_a_card_from_the_future_and_writes_nothing(written, capsys):
    card = json.loads((written / "card.json").read_text())
    (written / "card.json").write_text(json.dumps({**card, "card_version": CARD_VERSION + 1}))
    before = _snapshot(written)
    assert main(["card", "--from-json", str(written)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(written / "card.json") in line and f"version {CARD_VERSION + 1}" in line
    assert _snapshot(written) == before


def test_card_needs_a_model_or_a_written_card(capsys):
    assert main(["card"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--ckpt" in line and "--from-json" in line
