"""hybridpar.cluster"""
