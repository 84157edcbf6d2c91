-- name: lock
-- Serialise concurrent `tenantq migrate` runs on the same schema. A
-- transaction-level advisory lock is released by COMMIT or by the session
-- dying, so a killed migrator never leaves it held.
SELECT pg_advisory_xact_lock(hashtext('tenantq.migrate'), hashtext(%(schema)s));

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: applied_versions
SELECT version FROM migrations ORDER BY version;

-- name: record
INSERT INTO migrations (version, name) VALUES (%(version)s, %(name)s);

-- name: has_tables
-- Does the schema hold tenantq tables already (installed before migrations
-- were recorded, or half-installed)? Then schema.sql cannot be applied.
SELECT count(*) AS n FROM pg_tables WHERE schemaname = %(schema)s AND tablename <> 'migrations';
