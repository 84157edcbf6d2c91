from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Note",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name="ID")),
                ("tenant", models.CharField(max_length=64)),
                ("text", models.CharField(max_length=200)),
                ("job", models.BigIntegerField(null=True)),
                ("stamped_by", models.BigIntegerField(null=True)),
            ],
        ),
    ]
