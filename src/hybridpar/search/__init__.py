"""hybridpar.search"""
