"""hybridpar.runtime"""
