"""edge_client"""
