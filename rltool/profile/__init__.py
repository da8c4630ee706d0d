"""`rltool profile` (what a traced run did) and `rltool plan` (what to run, from cost models
calibrated by such traces). See docs/profile.md."""
