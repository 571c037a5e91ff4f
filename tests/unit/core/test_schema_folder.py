"""A folder of writer schemas as deployments mount it (relay.core.schemas.SchemaFolder)."""

from __future__ import annotations

import shutil
from pathlib import Path

from relay.core.schemas import SchemaFolder

DEMO = Path(__file__).resolve().parents[3] / "schemas" / "demo"


def test_a_folder_mounted_from_a_configmap_loads_each_schema_once(tmp_path: Path) -> None:
    """The kubelet lays a ConfigMap volume out as a dated folder holding the files, a
    ``..data`` link to it, and a link per file through ``..data`` (how
    deploy/k8s/examples/avro-schemas-patch.yaml mounts the writer schemas): each schema
    found three times made the relay refuse to start ("two writer schemas named ...")."""
    dated = tmp_path / "..2026_01_01_00_00_00.000000001"
    shutil.copytree(DEMO, dated)
    (tmp_path / "..data").symlink_to(dated.name)
    for schema in sorted(DEMO.glob("*.avsc")):
        (tmp_path / schema.name).symlink_to(Path("..data") / schema.name)
    mounted = SchemaFolder.from_dir(tmp_path)
    assert mounted.event_types == SchemaFolder.from_dir(DEMO).event_types
    assert len(mounted.event_types) == len(list(DEMO.glob("*.avsc")))
