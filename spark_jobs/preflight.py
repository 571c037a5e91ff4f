"""What a job checks of its arguments and folders before Spark starts (a minute, on a
busy machine): a mistake is a usage error (exit 2) naming the option, in a second,
rather than a failure after the session and the query have started."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from urllib.parse import urlparse

from relay.core.log_fields import log_extra
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.errors import ConfigError, RelayError

logger = logging.getLogger(__name__)

# The formats whose values may be Avro single-object encoded: their writer schemas are
# the relay's schemas folder.
_NEEDS_WRITER_SCHEMAS = ("auto", "avro")
SCHEMAS_HELP = (
    "the writer schemas' folder, as the relay's schemas_dir, for Avro single-object "
    "values (--format auto or avro); default: the relay's (RELAY_SCHEMAS_DIR, or the "
    "config file), else none"
)


def schemas_folder(
    parser: argparse.ArgumentParser, given: str | None, value_format: str, config: Path | None
) -> str | None:
    """The writer schemas' folder the job decodes with: ``--schemas``, else the relay's
    ``schemas_dir`` (``RELAY_SCHEMAS_DIR`` or the config file), read and checked here;
    None when the format needs none (``json``, ``avro-registry``), or under ``auto``
    when neither names one (a single-object Avro value is then undecodable, and says
    why). ``--format avro`` without one is a usage error."""
    if value_format not in _NEEDS_WRITER_SCHEMAS:
        return None
    folder = given
    if folder is None:
        try:
            relays = load_settings(config).schemas_dir
        except ConfigError as exc:
            parser.error(str(exc))
        folder = None if relays is None else str(relays)
    if folder is None:
        if value_format == "avro":
            parser.error(
                "--format avro needs the writer schemas: --schemas DIR, or the relay's "
                "schemas_dir (RELAY_SCHEMAS_DIR, or the config file)"
            )
        logger.info(
            "no schemas folder (--schemas, RELAY_SCHEMAS_DIR): Avro single-object values "
            "will be undecodable; JSON and schema-registry values decode as usual",
            extra=log_extra("spark_job_no_schemas"),
        )
        return None
    try:
        SchemaFolder.from_dir(Path(folder).absolute())  # the message says where it looked
    except RelayError as exc:
        parser.error(f"--schemas: {exc}")
    return folder


def checkpoint_folder(parser: argparse.ArgumentParser, location: str, option: str) -> str:
    """``location`` if Spark can keep a checkpoint there: a local folder (or one to be
    made) that can be written. Another file system's (``hdfs://``, ``s3a://``) is
    Spark's to check."""
    path = _local_path(location)
    if path is None:
        return location
    if path.exists() and not path.is_dir():
        parser.error(f"{option} {location}: a file, not a folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"{option} {location}: cannot write in {existing}")
    return location


def new_folder(parser: argparse.ArgumentParser, location: str, option: str) -> str:
    """``location``, which must not exist yet (a local one is checked here)."""
    path = _local_path(location)
    if path is not None and path.exists():
        parser.error(f"{option} {location}: exists already (a backfill writes a new folder)")
    if path is not None:
        checkpoint_folder(parser, location, option)  # writable
    return location


def offsets(parser: argparse.ArgumentParser, spec: str, option: str) -> str:
    """A Kafka source's offsets: ``earliest``, ``latest`` or a JSON object."""
    if spec in ("earliest", "latest"):
        return spec
    try:
        parsed = json.loads(spec)
    except ValueError as exc:
        parser.error(f"{option}: not earliest, latest or JSON ({exc})")
    if not isinstance(parsed, dict):
        parser.error(f'{option}: a JSON object is needed, {{"topic": {{"0": offset}}}}')
    return spec


def _local_path(location: str) -> Path | None:
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme and len(parsed.scheme) > 1:  # hdfs://, s3a://...
        return None
    return Path(location)


def offsets_limit(text: str) -> int:
    """An argparse type: a whole number of records, 0 (or ``none``) for no limit."""
    number = 0 if text.strip().lower() == "none" else int(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no limit) or more, got {number}")
    return number
