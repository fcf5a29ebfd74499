"""hybridpar.report"""
