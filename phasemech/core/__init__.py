"""The ground floor: configs, the compression grid and its reference grids, validation helpers,
atomic file writes and the progress bar. Imports nothing else from phasemech."""
