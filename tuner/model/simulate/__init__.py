"""Worker-side simulation (imports torch). Never imported by the daemon's main process."""
