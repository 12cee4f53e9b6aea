"""A checkpoint on disk, whichever engine wrote it (moved here from common/ and training/checkpoints/)."""
