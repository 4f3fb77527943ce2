"""The TypeScript dmutex's DynamoDB store, its requests replayed verbatim through boto3.

``src/dynamodb-store.ts`` (0.4.0, commit fa55975) sends these requests
through the AWS SDK for JavaScript; the same JSON goes out through boto3
here, driven by ``src/semaphore.ts``'s slot loops
(:class:`~tests._support.typescript.TypeScriptSemaphore`). Its clock is
its host's (``Date.now()``), as here; its table is ``tablePrefix +
serviceName`` made by ``createTable`` (``ResourceInUseException`` ignored),
then waited for until ACTIVE.
"""

from __future__ import annotations

import time
from typing import Any

from tests._support.typescript import TypeScriptSemaphore

CONDITION_FAILED = "ConditionalCheckFailedException"


def _failed_condition(error: Exception) -> bool:
    response = getattr(error, "response", {})
    return bool(response.get("Error", {}).get("Code") == CONDITION_FAILED)


class TypeScriptDynamo(TypeScriptSemaphore[int]):
    """The TypeScript ``DSemaphore`` (``DMutex``: one permit) on a DynamoDB-shaped table."""

    def __init__(self, client: Any, table: str, permits: int) -> None:
        self.client, self.table, self.max_permits = client, table, permits
        self.requests = 0
        self._create()

    def _create(self) -> None:
        try:
            self.client.create_table(
                TableName=self.table,
                AttributeDefinitions=[{"AttributeName": "key", "AttributeType": "S"}],
                KeySchema=[{"AttributeName": "key", "KeyType": "HASH"}],
                BillingMode="PAY_PER_REQUEST",
            )
        except Exception as error:
            if getattr(error, "response", {}).get("Error", {}).get("Code") != (
                "ResourceInUseException"
            ):
                raise
        deadline = time.monotonic() + 30
        while self.client.describe_table(TableName=self.table)["Table"]["TableStatus"] != "ACTIVE":
            assert time.monotonic() < deadline, "the table never became ACTIVE"
            time.sleep(0.25)

    def store_acquire(self, key: str, token: str, ttl_seconds: float) -> int | None:
        now = int(time.time() * 1000)
        expired_at = int(now + ttl_seconds * 1000)
        self.requests += 1
        try:
            self.client.put_item(
                TableName=self.table,
                Item={
                    "key": {"S": key},
                    "value": {"S": token},
                    "expiredAt": {"N": str(expired_at)},
                },
                ConditionExpression="attribute_not_exists(#key) OR #expiredAt <= :now",
                ExpressionAttributeNames={"#key": "key", "#expiredAt": "expiredAt"},
                ExpressionAttributeValues={":now": {"N": str(now)}},
            )
        except Exception as error:
            if _failed_condition(error):
                return None
            raise
        return expired_at

    def store_release(self, key: str, token: str) -> bool:
        self.requests += 1
        try:
            self.client.delete_item(
                TableName=self.table,
                Key={"key": {"S": key}},
                ConditionExpression="#value = :token",
                ExpressionAttributeNames={"#value": "value"},
                ExpressionAttributeValues={":token": {"S": token}},
            )
        except Exception as error:
            if _failed_condition(error):
                return False
            raise
        return True

    def store_extend(self, key: str, token: str, ttl_seconds: float) -> int | None:
        now = int(time.time() * 1000)
        expired_at = int(now + ttl_seconds * 1000)
        self.requests += 1
        try:
            answer = self.client.update_item(
                TableName=self.table,
                Key={"key": {"S": key}},
                UpdateExpression="SET #expiredAt = :expiredAt",
                ConditionExpression="#value = :token AND #expiredAt > :now",
                ExpressionAttributeNames={"#value": "value", "#expiredAt": "expiredAt"},
                ExpressionAttributeValues={
                    ":token": {"S": token},
                    ":now": {"N": str(now)},
                    ":expiredAt": {"N": str(expired_at)},
                },
                ReturnValues="UPDATED_NEW",
            )
        except Exception as error:
            if _failed_condition(error):
                return None
            raise
        return int(answer["Attributes"]["expiredAt"]["N"])
