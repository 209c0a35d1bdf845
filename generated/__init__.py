"""Generated kernels (committed). Everything here except this file is written by `dflashgen generate`."""
