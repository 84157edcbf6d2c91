"""The domain: what a job, a tenant and a schedule are, apart from where they
are stored or how they run. Validation (the rules every input meets, mirrored
by the schema's CHECKs), cron expressions, the records the store returns and
the formatting people read. It imports nothing of tenantq but its errors, so
the store, the registry, the settings, the secrets, the CLI and the web all
use it without depending on one another."""
