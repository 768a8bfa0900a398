"""Small helpers every layer uses, login-node tools included: atomic file writes, byte sizes both
ways, text tables. Imports neither torch nor Horovod, nor anything else of hvdtrain. Internal."""
