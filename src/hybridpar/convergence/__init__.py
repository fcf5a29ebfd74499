"""hybridpar.convergence"""
