"""The control plane's steps, one unit each: snapshot, reconcile, apply, housekeeping, events."""
