"""hybridpar.profile"""
