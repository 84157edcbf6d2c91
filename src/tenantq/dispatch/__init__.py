"""The dispatcher: leases batches, runs them, settles every job."""
