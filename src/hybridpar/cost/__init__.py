"""hybridpar.cost"""
