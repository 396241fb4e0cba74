"""The aggregator store's tables (SQLite, one file, WAL; contribution payloads in files beside it),
with what each row means.
:mod:`aggregator.storage.store` is the only module that reads or writes them, but for the
deployment tables: :mod:`aggregator.storage.deployments`."""

import enum

# 2: contribution payloads in files (aggregator/storage/blob_files.py), not in the table
# 3: the deployment tables (a version 2 store gains them, empty: MIGRATE_FROM_V2 is nothing more;
#    a version 3 store made before deployment_assignments / deployment_counters / device_tags gains
#    them the same way: every table is created if absent on open)
# 4: jobs.end_failures, the failed tries in a row of a job's end, kept across restarts
#    (aggregator/service/end_failures.py): a store of an earlier version gains the column
#    (ADDED_COLUMNS, added where absent on every open, as the tables are created)
# 5: deployment_devices.enrolled_at, the enrolment each assignment was sent to (a revoked id enrolled
#    again is a new device to a rollout): added as 4's column was, an earlier row given its device's
#    enrolment when the column is added (the best a store that never recorded it knows)
SCHEMA_VERSION = 5


class JobState(enum.StrEnum):
    """A job's stored state; what moves it is aggregator/service/job_lifecycle.py. A StrEnum, so
    the stored text, the API's JSON and comparisons with the plain strings stay as they were."""
    CREATED = "created"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    CANCELLING = "cancelling"       # the operator cancelled the served job: cancelled once its open round closes
    STOPPED = "stopped"             # the service gave up on it (its error says why); start/resume again
    CANCELLED = "cancelled"
    DONE = "done"
    FAILED = "failed"               # no contribution at all (service/job_outcome.py), or its end raised (job_runner.py)


JOB_STATES = tuple(JobState)
FINAL_JOB_STATES = (JobState.CANCELLED, JobState.DONE, JobState.FAILED)

# the payload of row ``seq`` is the file ``<db path>.blobs/<seq>.msg``, of ``payload_bytes`` bytes
CONTRIBUTIONS = """CREATE TABLE IF NOT EXISTS {name} (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id        TEXT NOT NULL,
    round         INTEGER NOT NULL,
    device        TEXT NOT NULL,
    message_id    TEXT NOT NULL,
    payload_bytes INTEGER NOT NULL,
    received_at   REAL NOT NULL,
    UNIQUE (job_id, message_id),
    UNIQUE (job_id, round, device)
)"""
CONTRIBUTIONS_INDEX = "CREATE INDEX IF NOT EXISTS contributions_by_job ON contributions (job_id, seq)"

# the writes that change a device's place in the fleet, each noted in fleet_changes under the next seq
# (writers are serialised by SQLite's write lock, so seqs follow commit order)
_NOTE_FLEET_CHANGE = ("INSERT INTO fleet_changes (device_id, seq) VALUES ({row}.device_id, "
                      "(SELECT COALESCE(MAX(seq), 0) + 1 FROM fleet_changes)) "
                      "ON CONFLICT(device_id) DO UPDATE SET seq = excluded.seq")
FLEET_TRIGGERS = "\n".join(
    f"CREATE TRIGGER IF NOT EXISTS fleet_change_{table}_{event.split()[0].lower()} AFTER {event} ON {table} "
    f"FOR EACH ROW BEGIN {_NOTE_FLEET_CHANGE.format(row='OLD' if event == 'DELETE' else 'NEW')}; END;"
    for table, events in (("devices", ("INSERT", "UPDATE OF status", "DELETE")),
                          ("device_tags", ("INSERT", "UPDATE", "DELETE")))
    for event in events)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS devices (
    device_id     TEXT PRIMARY KEY,
    status        TEXT NOT NULL DEFAULT 'enrolled' CHECK (status IN ('enrolled', 'revoked')),
    public_key    BLOB,
    mqtt_password_hash TEXT,
    enrolled_at   REAL,
    revoked_at    REAL,
    last_seen     REAL,
    online        INTEGER NOT NULL DEFAULT 0,
    profile       TEXT NOT NULL DEFAULT '{}',
    cluster       TEXT
);
-- the tags the operator gave a device (a JSON list): what a deployment's tags: cohort selects by. A
-- device's own profile may announce tags too, shown and never trusted (a device would choose its canary).
-- Kept when the device is revoked and enrolled again: they describe the id's place in the fleet
CREATE TABLE IF NOT EXISTS device_tags (
    device_id     TEXT PRIMARY KEY REFERENCES devices(device_id) ON DELETE CASCADE,
    tags          TEXT NOT NULL
);
-- per device, the last change to what a deployment's cohort reads of it (enrolled, revoked, deleted,
-- its operator tags: aggregator.storage.devices.FLEET_READ), numbered in commit order: a reader keeps
-- the fleet in memory and reads only the rows changed after the highest seq it has seen
-- (aggregator/deployments/fleet_view.py). Kept by triggers, so every writer of any process and
-- version is counted; one row per device id, so it never grows past the fleet
CREATE TABLE IF NOT EXISTS fleet_changes (
    device_id     TEXT PRIMARY KEY,
    seq           INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS fleet_changes_by_seq ON fleet_changes (seq);
{fleet_triggers}
CREATE TABLE IF NOT EXISTS jobs (
    job_id      TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,
    config      TEXT NOT NULL,
    state       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    started_at  REAL,
    finished_at REAL,
    counters    TEXT,
    summary     TEXT,
    end_failures INTEGER NOT NULL DEFAULT 0     -- its end's failed tries in a row (0 again once queued)
);
-- the admin API lists jobs and deployments a page at a time in creation order (storage/pages.py)
CREATE INDEX IF NOT EXISTS jobs_by_creation ON jobs (created_at, job_id);
CREATE TABLE IF NOT EXISTS rounds (
    job_id       TEXT NOT NULL REFERENCES jobs(job_id),
    round        INTEGER NOT NULL,
    state        TEXT NOT NULL CHECK (state IN ('open', 'closed')),
    participants TEXT NOT NULL,
    tasks        TEXT NOT NULL,
    bookkeeping  TEXT NOT NULL,
    opened_at    REAL NOT NULL,
    deadline     REAL NOT NULL,
    closed_at    REAL,
    outcome      TEXT,
    bytes_in     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, round)
);
CREATE TABLE IF NOT EXISTS round_events (
    job_id  TEXT NOT NULL,
    round   INTEGER NOT NULL,
    device  TEXT NOT NULL,
    event   TEXT NOT NULL CHECK (event IN ('declined', 'rejected')),
    reason  TEXT NOT NULL,
    at      REAL NOT NULL,
    PRIMARY KEY (job_id, round, device)
);
{contributions};
CREATE TABLE IF NOT EXISTS quarantine (
    job_id      TEXT NOT NULL,
    round       INTEGER NOT NULL,
    device      TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    reason      TEXT NOT NULL,
    at          REAL NOT NULL,
    PRIMARY KEY (job_id, message_id)
);
CREATE TABLE IF NOT EXISTS forgotten (
    job_id        TEXT NOT NULL,
    device        TEXT NOT NULL,
    contributions INTEGER NOT NULL,
    at            REAL NOT NULL,
    PRIMARY KEY (job_id, device)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id      TEXT PRIMARY KEY,
    round       INTEGER NOT NULL,
    state       BLOB NOT NULL,
    contributed TEXT NOT NULL,
    created_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS evaluations (
    job_id TEXT NOT NULL,
    idx    INTEGER NOT NULL,
    entry  TEXT NOT NULL,
    PRIMARY KEY (job_id, idx)
);
CREATE TABLE IF NOT EXISTS models (
    model_id      INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id        TEXT NOT NULL,
    version       INTEGER NOT NULL,
    round         INTEGER NOT NULL,
    parent_id     INTEGER REFERENCES models(model_id),
    contributions INTEGER NOT NULL,
    sha256        TEXT NOT NULL,
    arrays        BLOB NOT NULL,
    metrics       TEXT NOT NULL,
    final         INTEGER NOT NULL DEFAULT 0,
    created_at    REAL NOT NULL,
    UNIQUE (job_id, version)
);
CREATE TABLE IF NOT EXISTS clusters (
    cluster_id TEXT PRIMARY KEY,
    label      TEXT NOT NULL DEFAULT '',
    job_id     TEXT,
    model_id   INTEGER,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS deployments (
    deployment_id TEXT PRIMARY KEY,
    model_id      INTEGER NOT NULL,
    state         TEXT NOT NULL,
    spec          TEXT NOT NULL,    -- aggregator.deployments.machine.Deployment.to_dict(): rule, stage, history
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS deployment_devices (
    deployment_id TEXT NOT NULL,
    device        TEXT NOT NULL,
    sent          TEXT NOT NULL CHECK (sent IN ('run', 'rollback')),   -- the last assignment published
    sent_at       REAL NOT NULL,
    report        TEXT,             -- its last report on the candidate (JSON), if any
    -- the device's enrolment (devices.enrolled_at) the assignment was sent to: its report counts only
    -- while that is the device's enrolment; a revoked id enrolled again is sent the run afresh
    enrolled_at   REAL,
    PRIMARY KEY (deployment_id, device)
);
-- each device's last assignment (run or rollback, of any deployment) and its sequence: a report is
-- taken only about it, and the next one sent has a higher seq (devices refuse a lower one)
CREATE TABLE IF NOT EXISTS deployment_assignments (
    device        TEXT PRIMARY KEY,
    deployment_id TEXT NOT NULL,
    seq           INTEGER NOT NULL,
    sent          TEXT NOT NULL CHECK (sent IN ('run', 'rollback'))
);
-- per deployment, how many reports were refused as late (not about the device's last assignment)
-- and how many refusals devices reported, by class (name ``late_reports`` or ``refused:<class>``)
CREATE TABLE IF NOT EXISTS deployment_counters (
    deployment_id TEXT NOT NULL,
    name          TEXT NOT NULL,
    value         INTEGER NOT NULL,
    PRIMARY KEY (deployment_id, name)
);
CREATE TABLE IF NOT EXISTS settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
{index};
""".replace("{contributions}", CONTRIBUTIONS.format(name="contributions")).replace("{index}", CONTRIBUTIONS_INDEX) \
    .replace("{fleet_triggers}", FLEET_TRIGGERS)

# the columns a later version added to a table an earlier one made: (table, column, its declaration,
# the statement that fills it in the rows the table held, or "")
ADDED_COLUMNS = (("jobs", "end_failures", "INTEGER NOT NULL DEFAULT 0", ""),
                 ("deployment_devices", "enrolled_at", "REAL", "UPDATE deployment_devices SET enrolled_at = "
                  "(SELECT enrolled_at FROM devices WHERE devices.device_id = deployment_devices.device)"))

# Version 1 kept each payload in the table (``contributions.payload BLOB``). Once every payload is in
# its file, the table is rebuilt in the version 2 shape (same seqs); the caller keeps the AUTOINCREMENT
# high-water mark, which dropping the old table forgets.
MIGRATE_FROM_V1 = (
    CONTRIBUTIONS.format(name="contributions_v2"),
    "INSERT INTO contributions_v2 (seq, job_id, round, device, message_id, payload_bytes, received_at) "
    "SELECT seq, job_id, round, device, message_id, length(payload), received_at FROM contributions",
    "DROP TABLE contributions",
    "ALTER TABLE contributions_v2 RENAME TO contributions",
    CONTRIBUTIONS_INDEX,
)
