"""OpenAI-compatible endpoints (being written)."""

from fastapi import APIRouter

router = APIRouter()
