"""The publish pipeline: candidate pool -> runtime module -> versioned snapshot, and the CLI."""
